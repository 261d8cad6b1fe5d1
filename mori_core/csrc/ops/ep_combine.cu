// Host entry points of the combine kernels; the kernels themselves are in
// ep_combine.cuh, instantiated per variant in ep_combine_{bf16,fp32,fp8,std}.cu.
#include "ops/ep_combine.cuh"

namespace mori::ep {

void LaunchCombine(const EpKernelArgs& args, const CombineParams& params, CombineDtype dtype, bool push, int blocks,
                   int warps, gpuStream_t stream) {
  const int threads = warps * dev::kWarpSize;
  if (params.standard_moe)
    dev::LaunchCombineStd(args, params, dtype, blocks, threads, stream);
  else if (params.quant != kQuantNone)
    dev::LaunchCombineFp8(args, params, push, blocks, threads, stream);
  else if (dtype == CombineDtype::kBf16)
    dev::LaunchCombineBf16(args, params, push, blocks, threads, stream);
  else
    dev::LaunchCombineFp32(args, params, push, blocks, threads, stream);
  MORI_GPU_CHECK(gpuGetLastError());
}

int CombineMaxCoResidentBlocks(int world, CombineDtype dtype, bool push, int quant, bool standard_moe, int warps,
                               int device) {
  DeviceGuard guard(device);
  const int threads = warps * dev::kWarpSize;
  int per_sm = 0;
  if (standard_moe)
    per_sm = dev::CombineBlocksPerSmStd(world, dtype, quant, threads);
  else if (quant != kQuantNone)
    per_sm = dev::CombineBlocksPerSmFp8(world, quant, push, threads);
  else
    per_sm = dtype == CombineDtype::kBf16 ? dev::CombineBlocksPerSmBf16(world, push, threads)
                                          : dev::CombineBlocksPerSmFp32(world, push, threads);
  int sms = 0;
  MORI_GPU_CHECK(gpuDeviceGetAttribute(&sms, gpuDevAttrMultiProcessorCount, device));
  return per_sm * sms;
}

int CombineMaxCoResidentBlocks(int world, CombineDtype dtype, bool push, int warps, int device) {
  return CombineMaxCoResidentBlocks(world, dtype, push, kQuantNone, false, warps, device);
}

}  // namespace mori::ep
