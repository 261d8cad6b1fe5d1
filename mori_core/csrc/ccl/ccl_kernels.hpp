// Launchers of the MORI-CCL kernels (host side; the kernels are in ccl_kernels.cu).
#pragma once

#include "ccl/ccl_types.hpp"
#include "common/gpu_runtime.hpp"

#if MORI_WITH_GPU
namespace mori::ccl {

// One SM collective (path kSmAllGather, kSmAllToAll, kSmOneShot or kSmTwoShot) of `phase`
// on `stream`, `blocks` x `threads`. Picks 16-, 4- or 1-byte accesses from the alignment.
void LaunchSmCollective(Path path, RedType red, const SmSync& sync, const SmArgs& args, int phase, int blocks,
                        int threads, gpuStream_t stream);

// The copy-engine all-reduce's local reduce of this rank's shard.
void LaunchCeReduce(RedType red, const CeReduceArgs& args, int blocks, int threads, gpuStream_t stream);

// close(): one more barrier round with every peer (so no peer still reads this rank's
// buffers) and, when `ce_freed` is given, every peer's last copy-engine "freed" signal.
void LaunchClose(const SmSync& sync, const uint32_t* ce_freed, gpuStream_t stream);

}  // namespace mori::ccl
#endif
