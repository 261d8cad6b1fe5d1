// Host entry points of the EP kernels (implemented in ep_dispatch.cu /
// ep_combine.cu). All launches are asynchronous on the given stream.
#pragma once

#include <cstddef>

#include "common/gpu_runtime.hpp"
#include "ops/ep_types.hpp"

namespace mori::ep {

enum class CombineDtype : int { kBf16 = 0, kFp32 = 1 };

// Threads per warp of the kernels on this vendor (32 NVIDIA, 64 AMD gfx9).
int KernelWarpSize();
// Threads per block the kernels are compiled for (128 registers per thread).
constexpr int kDispatchMaxThreads = 512;
constexpr int kCombineMaxThreads = 512;

void LaunchDispatch(const EpKernelArgs& args, const DispatchParams& params, int blocks, int warps, gpuStream_t stream);
void LaunchCombine(const EpKernelArgs& args, const CombineParams& params, CombineDtype dtype, bool push, int blocks,
                   int warps, gpuStream_t stream);
// Launches an empty kernel (one warp) with a tiny or a dispatch-sized
// parameter block, through the runtime or (CUDA) the driver API: the
// benchmark's floor for the host cost of one launch.
void LaunchEmptyKernel(bool dispatch_sized_args, bool driver_api, gpuStream_t stream);
// Most blocks of the combine kernel that fit on the device at once: combine
// blocks wait for each other, so its grid must be co-resident.
int CombineMaxCoResidentBlocks(int world, CombineDtype dtype, bool push, int warps, int device);

}  // namespace mori::ep
