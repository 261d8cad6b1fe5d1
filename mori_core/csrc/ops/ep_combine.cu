// Host entry points of the combine kernels; the kernels themselves are in
// ep_combine.cuh, instantiated per dtype in ep_combine_{bf16,fp32}.cu.
#include "ops/ep_combine.cuh"

namespace mori::ep {

void LaunchCombine(const EpKernelArgs& args, const CombineParams& params, CombineDtype dtype, bool push, int blocks,
                   int warps, gpuStream_t stream) {
  const int threads = warps * dev::kWarpSize;
  if (dtype == CombineDtype::kBf16)
    dev::LaunchCombineBf16(args, params, push, blocks, threads, stream);
  else
    dev::LaunchCombineFp32(args, params, push, blocks, threads, stream);
  MORI_GPU_CHECK(gpuGetLastError());
}

int CombineMaxCoResidentBlocks(int world, CombineDtype dtype, bool push, int warps, int device) {
  DeviceGuard guard(device);
  const int threads = warps * dev::kWarpSize;
  const int per_sm = dtype == CombineDtype::kBf16 ? dev::CombineBlocksPerSmBf16(world, push, threads)
                                                  : dev::CombineBlocksPerSmFp32(world, push, threads);
  int sms = 0;
  MORI_GPU_CHECK(gpuDeviceGetAttribute(&sms, gpuDevAttrMultiProcessorCount, device));
  return per_sm * sms;
}

}  // namespace mori::ep
