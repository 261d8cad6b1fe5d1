// What the all-reduce kernels of one dtype need to launch (one translation unit per dtype:
// ccl_reduce_<dtype>.cu, built in parallel).
#pragma once

#include "ccl/ccl_types.hpp"
#include "common/gpu_runtime.hpp"

#if MORI_WITH_GPU
namespace mori::ccl {

struct ReduceLaunch {
  Path path = Path::kNone;          // kSmOneShot / kSmTwoShot; kNone with `ce` set: the copy-engine reduce
  const SmSync* sync = nullptr;
  const SmArgs* args = nullptr;
  const CeReduceArgs* ce = nullptr;
  int npes = 0;                     // the copy-engine reduce's rank count (SM paths read sync->npes)
  int phase = kPhaseFull;
  dim3 grid, block;
  gpuStream_t stream = nullptr;
};

void LaunchReduceF32(const ReduceLaunch& l);
void LaunchReduceF16(const ReduceLaunch& l);
void LaunchReduceBF16(const ReduceLaunch& l);
void LaunchReduceI32(const ReduceLaunch& l);

inline void LaunchReduce(RedType red, const ReduceLaunch& l) {
  switch (red) {
    case RedType::kF32: LaunchReduceF32(l); break;
    case RedType::kF16: LaunchReduceF16(l); break;
    case RedType::kBF16: LaunchReduceBF16(l); break;
    case RedType::kI32: LaunchReduceI32(l); break;
    default: break;
  }
}

}  // namespace mori::ccl
#endif
