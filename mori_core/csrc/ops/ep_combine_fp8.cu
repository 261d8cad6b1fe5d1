// Combine with FP8 transport of the rows that cross the link (quant_type
// fp8_direct_cast / fp8_blockwise; bf16 rows; see ep_combine.cuh and ep_quant.cuh).
#include "ops/ep_combine.cuh"

namespace mori::ep::dev {

using Fp8CastCombine = CombineVariant<Bf16Tag, kQuantFp8Cast, false>;
using Fp8BlockCombine = CombineVariant<Bf16Tag, kQuantFp8Block, false>;

void LaunchCombineFp8(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                      gpuStream_t stream) {
  if (params.quant == kQuantFp8Block)
    Fp8BlockCombine::LaunchFor(args, params, push, blocks, threads, stream);
  else
    Fp8CastCombine::LaunchFor(args, params, push, blocks, threads, stream);
}

int CombineBlocksPerSmFp8(int world, int quant, bool push, int threads) {
  return quant == kQuantFp8Block ? Fp8BlockCombine::BlocksPerSmForWorld(world, push, threads)
                                 : Fp8CastCombine::BlocksPerSmForWorld(world, push, threads);
}

}  // namespace mori::ep::dev
