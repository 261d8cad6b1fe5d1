#include "common/gpu_runtime.hpp"

#include <algorithm>
#include <cctype>

#include "common/error.hpp"

#if MORI_WITH_GPU && defined(MORI_GPU_CUDA)
#include <cuda.h>
#endif

namespace mori {

int GpuDeviceCount() {
#if MORI_WITH_GPU
  int n = 0;
  if (gpuGetDeviceCount(&n) != gpuSuccess) {
    (void)gpuGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

#if MORI_WITH_GPU
void ThrowGpuError(gpuError_t err, const char* expr, const char* file, int line) {
  // A failed runtime call also becomes the thread's "last error". Reset it here, so that the next
  // launch's gpuGetLastError() check reports that launch and not this call, which was already
  // reported by this throw (a bench caught a refused cudaMemcpyBatchAsync and then saw its
  // "invalid argument" blamed on the next, valid, kernel launch). Sticky errors stay set.
  (void)gpuGetLastError();
  throw GpuError(std::string(expr) + " failed: " + gpuGetErrorString(err) + " (" + file + ":" +
                 std::to_string(line) + ")");
}

DeviceGuard::DeviceGuard(int device) {
  if (device < 0) return;
  MORI_GPU_CHECK(gpuGetDevice(&previous_));
  if (previous_ != device) {
    MORI_GPU_CHECK(gpuSetDevice(device));
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) (void)gpuSetDevice(previous_);
}

std::string GpuPciBusId(int device) {
  char buf[64] = {0};
  if (gpuDeviceGetPCIBusId(buf, sizeof(buf), device) != gpuSuccess) {
    (void)gpuGetLastError();
    return "";
  }
  std::string s(buf);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

void GpuAllocationRange(const void* ptr, void** base, size_t* size) {
#if defined(MORI_GPU_HIP)
  MORI_GPU_CHECK(hipMemGetAddressRange(base, size, const_cast<void*>(ptr)));
#else
  // The runtime API has no address-range query; the driver API does and is
  // reachable through the runtime's entry-point table without linking libcuda.
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<Fn>(p);
  }();
  if (!fn) throw GpuError("cuMemGetAddressRange is not available from the CUDA driver");
  CUdeviceptr b = 0;
  size_t s = 0;
  CUresult r = fn(&b, &s, reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS)
    throw GpuError("cuMemGetAddressRange failed (CUresult " + std::to_string(static_cast<int>(r)) +
                   "): the pointer is not device memory from cudaMalloc");
  *base = reinterpret_cast<void*>(b);
  *size = s;
#endif
}
#endif

}  // namespace mori
