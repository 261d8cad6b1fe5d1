// The all-reduce kernels of one dtype (see ccl_reduce.cuh).
#include "ccl/ccl_reduce.cuh"

namespace mori::ccl {
void LaunchReduceI32(const ReduceLaunch& l) { dev::LaunchReduceFor<RedType::kI32>(l); }
}  // namespace mori::ccl
