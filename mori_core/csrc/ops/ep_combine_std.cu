// Combine of the standard-MoE (3-D) layout: combine_standard_moe (push; with or
// without FP8 transport). See ep_combine.cuh.
#include "ops/ep_combine.cuh"

namespace mori::ep::dev {

void LaunchCombineStd(const EpKernelArgs& args, const CombineParams& params, CombineDtype dtype, int blocks,
                      int threads, gpuStream_t stream) {
  if (dtype == CombineDtype::kFp32)
    CombineVariant<float, kQuantNone, true>::LaunchFor(args, params, true, blocks, threads, stream);
  else if (params.quant == kQuantFp8Block)
    CombineVariant<Bf16Tag, kQuantFp8Block, true>::LaunchFor(args, params, true, blocks, threads, stream);
  else if (params.quant == kQuantFp8Cast)
    CombineVariant<Bf16Tag, kQuantFp8Cast, true>::LaunchFor(args, params, true, blocks, threads, stream);
  else
    CombineVariant<Bf16Tag, kQuantNone, true>::LaunchFor(args, params, true, blocks, threads, stream);
}

int CombineBlocksPerSmStd(int world, CombineDtype dtype, int quant, int threads) {
  if (dtype == CombineDtype::kFp32) return CombineVariant<float, kQuantNone, true>::BlocksPerSmForWorld(world, true, threads);
  if (quant == kQuantFp8Block) return CombineVariant<Bf16Tag, kQuantFp8Block, true>::BlocksPerSmForWorld(world, true, threads);
  if (quant == kQuantFp8Cast) return CombineVariant<Bf16Tag, kQuantFp8Cast, true>::BlocksPerSmForWorld(world, true, threads);
  return CombineVariant<Bf16Tag, kQuantNone, true>::BlocksPerSmForWorld(world, true, threads);
}

}  // namespace mori::ep::dev
