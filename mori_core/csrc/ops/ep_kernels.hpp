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
// Most dynamic shared memory a dispatch block may ask for (AMD's LDS per workgroup).
constexpr size_t kDispatchMaxSmem = 64 * 1024;

void LaunchDispatch(const EpKernelArgs& args, const DispatchParams& params, int blocks, int warps, gpuStream_t stream);
// Most dispatch blocks of `standard_moe` (EpStdMode) that fit on the device at once: the
// one-launch standard-MoE dispatch's blocks wait for each other before its expand tail.
int DispatchMaxCoResidentBlocks(int world, int standard_moe, int num_experts, int topk, int warps, int device);
// Dynamic shared memory of a dispatch block; `standard_moe` as DispatchParams::standard_moe (the
// standard-MoE modes add per-token positions, the fused one also per-expert counts).
size_t DispatchSmemBytes(int threads, int world, int standard_moe, int num_experts, int topk);
void LaunchCombine(const EpKernelArgs& args, const CombineParams& params, CombineDtype dtype, bool push, int blocks,
                   int warps, gpuStream_t stream);
// Launches an empty kernel (one warp) with a tiny or a dispatch-sized
// parameter block, through the runtime or (CUDA) the driver API: the
// benchmark's floor for the host cost of one launch.
void LaunchEmptyKernel(bool dispatch_sized_args, bool driver_api, gpuStream_t stream);
// Most blocks of the combine kernel that fit on the device at once: combine
// blocks wait for each other, so its grid must be co-resident.
int CombineMaxCoResidentBlocks(int world, CombineDtype dtype, bool push, int warps, int device);
// The same for a given FP8 transport (EpCombineQuant) and standard-MoE input.
int CombineMaxCoResidentBlocks(int world, CombineDtype dtype, bool push, int quant, bool standard_moe, int warps,
                               int device);

// Standard-MoE layout (ep_standard_moe.cu). All asynchronous on `stream`.
// Plan of dispatch_standard_moe (three-launch path, MORI_EP_STD_FUSED=0): ranks this
// rank's tokens per expert and publishes the per-expert counts to every rank;
// LaunchDispatch with standard_moe = 1 and LaunchStdExpand follow. The fused path
// (standard_moe = 2) does this inside the dispatch kernel.
void LaunchStdPlan(const EpKernelArgs& args, const int32_t* indices, int num_tokens, int blocks, gpuStream_t stream);
// dispatch_standard_moe, after its LaunchDispatch: every received row (`row_bytes`) to its
// final [local expert][position] slots (a local copy). `planned`: the counts came from the plan
// kernels (checked against their flags), else with the dispatch's signal.
void LaunchStdExpand(const EpKernelArgs& args, int row_bytes, bool planned, int blocks, int warps, gpuStream_t stream);
// convert_dispatch_output: the received 2-D rows `x` (`x_rows` rows, `row_bytes` each)
// with their top-k ids into this rank's 3-D layout (scales from the dispatch outputs).
void LaunchConvertDispatch(const EpKernelArgs& args, const uint8_t* x, int row_bytes, int x_rows, const int32_t* ids,
                           int blocks, int warps, gpuStream_t stream);
// convert_combine_input: registered combine input row i = sum_k w_k * packed[std_row[i][k]].
void LaunchConvertCombine(const EpKernelArgs& args, const uint8_t* packed, int row_bytes, CombineDtype dtype,
                          int blocks, int warps, gpuStream_t stream);
constexpr int kStdPlanThreads = 256;

}  // namespace mori::ep
