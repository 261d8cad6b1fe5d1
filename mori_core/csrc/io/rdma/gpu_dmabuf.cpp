#include "io/rdma/gpu_dmabuf.hpp"

#include <unistd.h>

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"

#if MORI_WITH_GPU && defined(MORI_GPU_CUDA)
#include <cuda.h>
#endif

namespace mori::io::rdma {

GpuDmabuf ExportGpuDmabuf(int device, uint64_t ptr, uint64_t size, std::string* why) {
  GpuDmabuf out;
#if !MORI_WITH_GPU
  (void)device, (void)ptr, (void)size;
  *why = "this build of mori_core has no GPU support";
  return out;
#else
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = ptr & ~(page - 1);
  const uint64_t length = ((ptr + size - start) + page - 1) & ~(page - 1);
  try {
    // The export runs against the memory's device; the framework's current
    // device is restored afterwards (MORI PR #682 clobbered it).
    DeviceGuard guard(device);
    // Driver-API calls need the device's context current on this thread,
    // which may be a control-plane thread that never touched the GPU: any
    // runtime call binds the primary context, gpuFree(nullptr) is the no-op one.
    MORI_GPU_CHECK(gpuFree(nullptr));
#if defined(MORI_GPU_HIP)
    int fd = -1;
    hipError_t e = hipMemGetHandleForAddressRange(&fd, reinterpret_cast<hipDeviceptr_t>(start), length,
                                                  hipMemRangeHandleTypeDmaBufFd, 0);
    if (e != hipSuccess) {
      *why = std::string("hipMemGetHandleForAddressRange failed: ") + hipGetErrorString(e);
      return out;
    }
    out.fd = fd;
#else
    // Driver API, reached through the runtime's entry-point table so that
    // nothing links libcuda directly (same approach as GpuAllocationRange).
    using Fn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
    static Fn fn = [] {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q;
      if (cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &p, 11070, cudaEnableDefault, &q) !=
              cudaSuccess ||
          q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        p = nullptr;
      }
      return reinterpret_cast<Fn>(p);
    }();
    if (!fn) {
      *why = "the CUDA driver has no cuMemGetHandleForAddressRange (needs CUDA >= 11.7 and a dma-buf capable driver)";
      return out;
    }
    int fd = -1;
    CUresult r = fn(&fd, static_cast<CUdeviceptr>(start), length, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    if (r != CUDA_SUCCESS) {
      *why = "cuMemGetHandleForAddressRange failed (CUresult " + std::to_string(static_cast<int>(r)) +
             "; dma-buf needs the open GPU kernel modules or a driver with dma-buf support)";
      return out;
    }
    out.fd = fd;
#endif
  } catch (const std::exception& e) {
    *why = e.what();
    return out;
  }
  out.offset = ptr - start;
  return out;
#endif
}

}  // namespace mori::io::rdma
