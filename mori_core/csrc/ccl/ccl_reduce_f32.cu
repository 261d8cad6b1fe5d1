// The all-reduce kernels of one dtype (see ccl_reduce.cuh).
#include "ccl/ccl_reduce.cuh"

namespace mori::ccl {
void LaunchReduceF32(const ReduceLaunch& l) { dev::LaunchReduceFor<RedType::kF32>(l); }
}  // namespace mori::ccl
