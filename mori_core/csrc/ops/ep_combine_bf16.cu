// bf16 instantiations of the combine kernel (see ep_combine.cuh).
#include "ops/ep_combine.cuh"

namespace mori::ep::dev {

using Bf16Combine = CombineVariant<Bf16Tag, kQuantNone, false>;

void LaunchCombineBf16(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                       gpuStream_t stream) {
  Bf16Combine::LaunchFor(args, params, push, blocks, threads, stream);
}

int CombineBlocksPerSmBf16(int world, bool push, int threads) {
  return Bf16Combine::BlocksPerSmForWorld(world, push, threads);
}

}  // namespace mori::ep::dev
