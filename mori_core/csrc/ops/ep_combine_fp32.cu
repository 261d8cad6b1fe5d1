// fp32 instantiations of the combine kernel (see ep_combine.cuh).
#include "ops/ep_combine.cuh"

namespace mori::ep::dev {

using Fp32Combine = CombineVariant<float, kQuantNone, false>;

void LaunchCombineFp32(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                       gpuStream_t stream) {
  Fp32Combine::LaunchFor(args, params, push, blocks, threads, stream);
}

int CombineBlocksPerSmFp32(int world, bool push, int threads) {
  return Fp32Combine::BlocksPerSmForWorld(world, push, threads);
}

}  // namespace mori::ep::dev
