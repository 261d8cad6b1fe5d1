// Portability layer between CUDA and HIP.
//
// Every GPU call in the core goes through the `gpu*` names below, so the same
// source compiles with nvcc (NVIDIA) and hipcc (AMD). Host-only code may include
// this header in CPU-only builds: MORI_WITH_GPU is then 0 and only the error
// helpers are available.
#pragma once

#include <string>

#ifndef MORI_WITH_GPU
#define MORI_WITH_GPU 0
#endif

#if MORI_WITH_GPU
#if defined(MORI_WITH_HIP) || defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define MORI_GPU_HIP 1
using gpuError_t = hipError_t;
using gpuStream_t = hipStream_t;
using gpuEvent_t = hipEvent_t;
using gpuIpcMemHandle_t = hipIpcMemHandle_t;
using gpuPointerAttributes = hipPointerAttribute_t;
#define gpuSuccess hipSuccess
#define gpuErrorNotReady hipErrorNotReady
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuGetDevice hipGetDevice
#define gpuSetDevice hipSetDevice
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuDeviceGetPCIBusId hipDeviceGetPCIBusId
#define gpuDeviceCanAccessPeer hipDeviceCanAccessPeer
#define gpuDeviceEnablePeerAccess hipDeviceEnablePeerAccess
#define gpuDeviceSynchronize hipDeviceSynchronize
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuHostAlloc hipHostMalloc
#define gpuHostAllocDefault hipHostMallocDefault
#define gpuFreeHost hipHostFree
#define gpuHostRegister hipHostRegister
#define gpuHostUnregister hipHostUnregister
#define gpuHostRegisterDefault hipHostRegisterDefault
#define gpuMemcpy hipMemcpy
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemcpyPeerAsync hipMemcpyPeerAsync
#define gpuMemcpyDefault hipMemcpyDefault
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuMemset hipMemset
#define gpuMemsetAsync hipMemsetAsync
#define gpuStreamCreateWithFlags hipStreamCreateWithFlags
#define gpuStreamNonBlocking hipStreamNonBlocking
#define gpuStreamDestroy hipStreamDestroy
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuStreamWaitEvent hipStreamWaitEvent
#define gpuStreamQuery hipStreamQuery
#define gpuHostAllocMapped hipHostMallocMapped
#define gpuHostAllocPortable hipHostMallocPortable
#define gpuHostGetDevicePointer hipHostGetDevicePointer
#define gpuEventCreateWithFlags hipEventCreateWithFlags
#define gpuEventDisableTiming hipEventDisableTiming
#define gpuEventInterprocess hipEventInterprocess
#define gpuEventRecord hipEventRecord
#define gpuEventQuery hipEventQuery
#define gpuEventSynchronize hipEventSynchronize
#define gpuEventDestroy hipEventDestroy
#define gpuIpcGetMemHandle hipIpcGetMemHandle
#define gpuIpcOpenMemHandle hipIpcOpenMemHandle
#define gpuIpcCloseMemHandle hipIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#define gpuMemGetAddressRange hipMemGetAddressRange
#define gpuPointerGetAttributes hipPointerGetAttributes
#define gpuMemoryTypeDevice hipMemoryTypeDevice
#define gpuMemoryTypeHost hipMemoryTypeHost
#define gpuLaunchKernel hipLaunchKernel
#define gpuEventBlockingSync hipEventBlockingSync
#define gpuDeviceGetByPCIBusId hipDeviceGetByPCIBusId
#define gpuErrorPeerAccessAlreadyEnabled hipErrorPeerAccessAlreadyEnabled
#else
#include <cuda_runtime.h>
#define MORI_GPU_CUDA 1
using gpuError_t = cudaError_t;
using gpuStream_t = cudaStream_t;
using gpuEvent_t = cudaEvent_t;
using gpuIpcMemHandle_t = cudaIpcMemHandle_t;
using gpuPointerAttributes = cudaPointerAttributes;
#define gpuSuccess cudaSuccess
#define gpuErrorNotReady cudaErrorNotReady
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuGetDevice cudaGetDevice
#define gpuSetDevice cudaSetDevice
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuDeviceGetPCIBusId cudaDeviceGetPCIBusId
#define gpuDeviceCanAccessPeer cudaDeviceCanAccessPeer
#define gpuDeviceEnablePeerAccess cudaDeviceEnablePeerAccess
#define gpuDeviceSynchronize cudaDeviceSynchronize
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuHostAlloc cudaHostAlloc
#define gpuHostAllocDefault cudaHostAllocDefault
#define gpuFreeHost cudaFreeHost
#define gpuHostRegister cudaHostRegister
#define gpuHostUnregister cudaHostUnregister
#define gpuHostRegisterDefault cudaHostRegisterDefault
#define gpuMemcpy cudaMemcpy
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemcpyPeerAsync cudaMemcpyPeerAsync
#define gpuMemcpyDefault cudaMemcpyDefault
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuMemset cudaMemset
#define gpuMemsetAsync cudaMemsetAsync
#define gpuStreamCreateWithFlags cudaStreamCreateWithFlags
#define gpuStreamNonBlocking cudaStreamNonBlocking
#define gpuStreamDestroy cudaStreamDestroy
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuStreamWaitEvent cudaStreamWaitEvent
#define gpuStreamQuery cudaStreamQuery
#define gpuHostAllocMapped cudaHostAllocMapped
#define gpuHostAllocPortable cudaHostAllocPortable
#define gpuHostGetDevicePointer cudaHostGetDevicePointer
#define gpuEventCreateWithFlags cudaEventCreateWithFlags
#define gpuEventDisableTiming cudaEventDisableTiming
#define gpuEventInterprocess cudaEventInterprocess
#define gpuEventRecord cudaEventRecord
#define gpuEventQuery cudaEventQuery
#define gpuEventSynchronize cudaEventSynchronize
#define gpuEventDestroy cudaEventDestroy
#define gpuIpcGetMemHandle cudaIpcGetMemHandle
#define gpuIpcOpenMemHandle cudaIpcOpenMemHandle
#define gpuIpcCloseMemHandle cudaIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess
#define gpuMemoryTypeDevice cudaMemoryTypeDevice
#define gpuMemoryTypeHost cudaMemoryTypeHost
#define gpuLaunchKernel cudaLaunchKernel
#define gpuPointerGetAttributes cudaPointerGetAttributes
#define gpuEventBlockingSync cudaEventBlockingSync
#define gpuDeviceGetByPCIBusId cudaDeviceGetByPCIBusId
#define gpuErrorPeerAccessAlreadyEnabled cudaErrorPeerAccessAlreadyEnabled
#endif
#endif  // MORI_WITH_GPU

namespace mori {

// True when this build carries GPU support (independent of a GPU being present).
constexpr bool kBuiltWithGpu = MORI_WITH_GPU != 0;

// Number of visible GPUs, 0 in CPU-only builds or when no driver/device exists.
// Never throws: a missing driver simply means "no GPU".
int GpuDeviceCount();

#if MORI_WITH_GPU
// Throws mori::GpuError with the failing expression and the runtime's message.
void ThrowGpuError(gpuError_t err, const char* expr, const char* file, int line);

// Makes `device` current for the scope and restores the caller's device after:
// frameworks keep their own current device and must never see it changed.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

// Lower-case PCI bus id ("0000:1b:00.0") of a device, "" when unknown.
std::string GpuPciBusId(int device);

// Start address and size of the allocation that contains `ptr`.
void GpuAllocationRange(const void* ptr, void** base, size_t* size);
#endif

}  // namespace mori

#if MORI_WITH_GPU
#define MORI_GPU_CHECK(expr)                                                  \
  do {                                                                        \
    gpuError_t mori_gpu_err_ = (expr);                                        \
    if (mori_gpu_err_ != gpuSuccess)                                          \
      ::mori::ThrowGpuError(mori_gpu_err_, #expr, __FILE__, __LINE__);        \
  } while (0)
#endif
