// bf16 instantiations of the combine kernel (see ep_combine.cuh).
#include "ops/ep_combine.cuh"

namespace mori::ep::dev {

void LaunchCombineBf16(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                       gpuStream_t stream) {
  LaunchCombineFor<Bf16Tag>(args, params, push, blocks, threads, stream);
}

int CombineBlocksPerSmBf16(int world, bool push, int threads) { return MaxBlocksPerSmForWorld<Bf16Tag>(world, push, threads); }

}  // namespace mori::ep::dev
