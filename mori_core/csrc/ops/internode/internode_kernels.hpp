// Host entry points of the inter-node kernels (all asynchronous on `stream`).
#pragma once

#include <cuda_runtime.h>

#include "common/gpu_runtime.hpp"
#include "ops/internode/internode_types.hpp"

namespace mori::ep::inter {

constexpr int kMaxThreads = 512;

void LaunchDispatchSend(const InterArgs& args, const InterDispatchParams& params, int blocks, int warps,
                        cudaStream_t stream);
void LaunchDispatchRecv(const InterArgs& args, const InterDispatchParams& params, int blocks, int warps,
                        cudaStream_t stream);
// dtype: 0 = bf16, 1 = fp32.
void LaunchCombinePrep(const InterArgs& args, const InterCombineParams& params, int blocks, int warps,
                       cudaStream_t stream);
void LaunchCombineSend(const InterArgs& args, const InterCombineParams& params, int dtype, int blocks, int warps,
                       cudaStream_t stream);
void LaunchCombineRecv(const InterArgs& args, const InterCombineParams& params, int dtype, int blocks, int warps,
                       cudaStream_t stream);

}  // namespace mori::ep::inter
