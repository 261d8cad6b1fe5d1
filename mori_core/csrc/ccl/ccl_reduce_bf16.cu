// The all-reduce kernels of one dtype (see ccl_reduce.cuh).
#include "ccl/ccl_reduce.cuh"

namespace mori::ccl {
void LaunchReduceBF16(const ReduceLaunch& l) { dev::LaunchReduceFor<RedType::kBF16>(l); }
}  // namespace mori::ccl
