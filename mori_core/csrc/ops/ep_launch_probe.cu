// Empty kernels whose launch is the floor of any kernel launch on this host:
// the EP benchmark prints their host cost next to dispatch/combine's, so the
// part of a call that is the driver's (not ours) is measured, not guessed.
// Two paths: the runtime launch the EP kernels use, and (CUDA only) the
// driver's cuLaunchKernel on the same function, to show what the runtime layer
// itself adds.
#include <string>

#include "common/error.hpp"
#include "ops/ep_kernels.hpp"

#if !defined(MORI_WITH_HIP) && !defined(__HIPCC__)
#include <cuda.h>
#endif

namespace mori::ep {
namespace dev {

__global__ void EmptyKernelSmallArgs(int) {}
// Same parameter bytes as a dispatch launch (geometry, buffer table, peer
// deltas, per-call params): shows what the argument size adds.
__global__ void EmptyKernelDispatchArgs(EpKernelArgs, DispatchParams) {}

}  // namespace dev

namespace {

#if !defined(MORI_WITH_HIP) && !defined(__HIPCC__)
using CuLaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                      CUstream, void**, void**);

// cuLaunchKernel from the driver the runtime already loaded (no libcuda link).
CuLaunchKernelFn DriverLaunch() {
  static CuLaunchKernelFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    MORI_GPU_CHECK(cudaGetDriverEntryPointByVersion("cuLaunchKernel", &p, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || p == nullptr) throw GpuError("cuLaunchKernel entry point not found");
    return reinterpret_cast<CuLaunchKernelFn>(p);
  }();
  return fn;
}

CUfunction FunctionOf(const void* kernel) {
  cudaFunction_t f = nullptr;
  MORI_GPU_CHECK(cudaGetFuncBySymbol(&f, kernel));
  return reinterpret_cast<CUfunction>(f);
}
#endif

}  // namespace

void LaunchEmptyKernel(bool dispatch_sized_args, bool driver_api, gpuStream_t stream) {
  EpKernelArgs args{};
  DispatchParams params{};
  int small = 0;
  if (driver_api) {
#if !defined(MORI_WITH_HIP) && !defined(__HIPCC__)
    static const CUfunction f_small = FunctionOf(reinterpret_cast<const void*>(&dev::EmptyKernelSmallArgs));
    static const CUfunction f_big = FunctionOf(reinterpret_cast<const void*>(&dev::EmptyKernelDispatchArgs));
    void* small_params[] = {&small};
    void* big_params[] = {&args, &params};
    const CUresult r = DriverLaunch()(dispatch_sized_args ? f_big : f_small, 1, 1, 1, 32, 1, 1, 0,
                                      reinterpret_cast<CUstream>(stream), dispatch_sized_args ? big_params : small_params,
                                      nullptr);
    if (r != CUDA_SUCCESS) throw GpuError("cuLaunchKernel failed with CUresult " + std::to_string(static_cast<int>(r)));
    return;
#else
    throw InvalidArgument("driver_api launches are CUDA-only");
#endif
  }
  if (dispatch_sized_args)
    dev::EmptyKernelDispatchArgs<<<1, 32, 0, stream>>>(args, params);
  else
    dev::EmptyKernelSmallArgs<<<1, 32, 0, stream>>>(small);
  MORI_GPU_CHECK(gpuGetLastError());
}

}  // namespace mori::ep
