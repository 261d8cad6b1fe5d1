// The SM link probe (link_probe.hpp): plain kernels that do nothing but move bytes to or from
// peers, in the EP kernels' access patterns, with no routing, no signals and no waits. Their
// rate is what an EP kernel of the same pattern could reach on this fabric.
#include "ccl/link_probe.hpp"
#include "common/error.hpp"
#include "ops/device_primitives.hpp"
#include "shmem/gpu_ext.hpp"

namespace mori::ccl {
namespace {

using mori::ep::dev::kWarpSize;
using mori::ep::dev::LaneId;
using mori::ep::dev::LoadPeer;
using mori::ep::dev::LoadStream;
using mori::ep::dev::Store16;

constexpr int kUnroll = 8;  // 16-byte vectors in flight per lane, as the EP4 dispatch

struct ProbeParams {
  const uint8_t* src;
  uint8_t* targets[kLinkProbeMaxTargets];
  uint8_t* local_dst;
  int num_targets;
  uint64_t bytes;
  int chunk;
};

// p.targets[t] without indexing the parameter array at run time (which copies it to the stack).
__device__ __forceinline__ uint8_t* TargetAt(const ProbeParams& p, int t) {
  uint8_t* r = p.targets[0];
#pragma unroll
  for (int i = 1; i < kLinkProbeMaxTargets; ++i)
    if (i == t) r = p.targets[i];
  return r;
}

// kPushAll, kPushEach and kPull: a piece is kWarpSize * kUnroll vectors of one target's bytes.
template <LinkProbeMode kMode>
__global__ void LinkProbe16(ProbeParams p) {
  const int lane = LaneId(), nwarps = blockDim.x / kWarpSize;
  const uint64_t warp = static_cast<uint64_t>(blockIdx.x) * nwarps + threadIdx.x / kWarpSize;
  const uint64_t all_warps = static_cast<uint64_t>(gridDim.x) * nwarps;
  const uint64_t vecs = p.bytes / 16, per_piece = static_cast<uint64_t>(kWarpSize) * kUnroll;
  const uint64_t pieces = (vecs + per_piece - 1) / per_piece;
  // targets interleaved so that every link is busy from the start
  const uint64_t items = kMode == LinkProbeMode::kPushAll ? pieces : pieces * p.num_targets;
  for (uint64_t item = warp; item < items; item += all_warps) {
    const int t = kMode == LinkProbeMode::kPushAll ? 0 : static_cast<int>(item % p.num_targets);
    const uint64_t piece = kMode == LinkProbeMode::kPushAll ? item : item / p.num_targets;
    const uint64_t v0 = piece * per_piece + lane;
    int4 x[kUnroll];
    if constexpr (kMode == LinkProbeMode::kPull) {
      const int4* from = reinterpret_cast<const int4*>(TargetAt(p, t));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * kWarpSize < vecs) x[u] = LoadPeer(from + v0 + u * kWarpSize);
      int4* to = reinterpret_cast<int4*>(p.local_dst) + static_cast<uint64_t>(t) * vecs;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * kWarpSize < vecs) Store16(to + v0 + u * kWarpSize, x[u]);
    } else {
      const int4* from = reinterpret_cast<const int4*>(p.src);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * kWarpSize < vecs) x[u] = LoadStream(from + v0 + u * kWarpSize);
#pragma unroll
      for (int tt = 0; tt < kLinkProbeMaxTargets; ++tt) {
        if (kMode == LinkProbeMode::kPushAll ? tt >= p.num_targets : tt != t) continue;
        int4* to = reinterpret_cast<int4*>(p.targets[tt]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (v0 + u * kWarpSize < vecs) Store16(to + v0 + u * kWarpSize, x[u]);
      }
    }
  }
}

#if defined(MORI_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MORI_LINK_PROBE_TMA 1
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred P1;\n\tWAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
      "@P1 bra DONE_%=;\n\tbra WAIT_%=;\n\tDONE_%=:\n\t}" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}
#endif

// kPushTma: lane 0 of each warp runs a two-stage pipeline: bulk-load piece i into stage i & 1
// (waiting for that stage's stores of piece i - 2 to have read it), then bulk-store it to every
// target. The loads of piece i + 1 overlap the stores of piece i.
__global__ void LinkProbeTma(ProbeParams p) {
#ifdef MORI_LINK_PROBE_TMA
  extern __shared__ __align__(128) uint8_t smem[];
  const int nwarps = blockDim.x / kWarpSize, w = threadIdx.x / kWarpSize;
  if (LaneId() != 0) return;
  uint8_t* stage = smem + static_cast<size_t>(w) * 2 * p.chunk;
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(nwarps) * 2 * p.chunk) + 2 * w;
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SmemAddr(bar)));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SmemAddr(bar + 1)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const uint64_t warp = static_cast<uint64_t>(blockIdx.x) * nwarps + w;
  const uint64_t all_warps = static_cast<uint64_t>(gridDim.x) * nwarps;
  const uint64_t pieces = (p.bytes + p.chunk - 1) / p.chunk;
  uint32_t parity = 0;
  int i = 0;
  for (uint64_t piece = warp; piece < pieces; piece += all_warps, ++i) {
    const int s = i & 1;
    const uint64_t off = piece * p.chunk;
    const uint64_t left = p.bytes - off;
    const uint32_t n = static_cast<uint32_t>(left < static_cast<uint64_t>(p.chunk) ? left : p.chunk);
    uint8_t* buf = stage + s * p.chunk;
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // piece i - 2 left stage s
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar + s)), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     SmemAddr(buf)),
                 "l"(p.src + off), "r"(n), "r"(SmemAddr(bar + s))
                 : "memory");
    MbarWait(bar + s, (parity >> s) & 1u);
    parity ^= 1u << s;
#pragma unroll
    for (int t = 0; t < kLinkProbeMaxTargets; ++t)
      if (t < p.num_targets)
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(p.targets[t] + off),
                     "r"(SmemAddr(buf)), "r"(n)
                     : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the stores are done when the kernel is
#endif
}

bool Aligned16(uintptr_t v) { return (v & 15u) == 0; }

// kPushTma's dynamic shared memory: two chunk-byte stages and two 8-byte mbarriers per warp.
size_t TmaSmemBytes(const LinkProbeArgs& a) { return static_cast<size_t>(a.warps) * (2 * static_cast<size_t>(a.chunk) + 16); }

}  // namespace

std::string LinkProbeProblem(const LinkProbeArgs& a, int device) {
  const int mode = static_cast<int>(a.mode);
  if (mode < 0 || mode > static_cast<int>(LinkProbeMode::kPull))
    return "mode: 0 (push_all), 1 (push_each), 2 (push_tma) or 3 (pull), got " + std::to_string(mode);
  const int n = static_cast<int>(a.targets.size());
  if (n < 1 || n > kLinkProbeMaxTargets)
    return "targets: 1 to " + std::to_string(kLinkProbeMaxTargets) + " addresses, got " + std::to_string(n);
  if (a.bytes == 0 || a.bytes % 16 != 0) return "bytes: a positive multiple of 16, got " + std::to_string(a.bytes);
  if (a.blocks < 1 || a.blocks > 65535) return "blocks: 1 to 65535, got " + std::to_string(a.blocks);
  if (a.warps < 1 || a.warps > 1024 / kWarpSize)
    return "warps: 1 to " + std::to_string(1024 / kWarpSize) + " per block, got " + std::to_string(a.warps);
  for (uintptr_t t : a.targets)
    if (t == 0 || !Aligned16(t)) return "targets: every address non-null and 16-byte aligned";
  if (a.mode == LinkProbeMode::kPull) {
    if (a.local_dst == 0 || !Aligned16(a.local_dst)) return "local_dst: a 16-byte aligned address for pulls";
  } else if (a.src == 0 || !Aligned16(a.src)) {
    return "src: a 16-byte aligned address for pushes";
  }
  if (a.mode == LinkProbeMode::kPushTma) {
#if defined(MORI_GPU_CUDA)
    if (a.chunk < 16 || a.chunk % 16 != 0 || a.chunk > 32768)
      return "chunk: a multiple of 16 from 16 to 32768 bytes, got " + std::to_string(a.chunk);
    int major = 0;
    MORI_GPU_CHECK(gpuDeviceGetAttribute(&major, gpuDevAttrComputeCapabilityMajor, device));
    gpuFuncAttributes attr{};
    MORI_GPU_CHECK(cudaFuncGetAttributes(&attr, LinkProbeTma));
    if (major < 9 || attr.binaryVersion < 90)
      return "mode push_tma: needs sm_90 bulk copies (device major " + std::to_string(major) + ", kernel built for " +
             std::to_string(attr.binaryVersion) + ")";
    const size_t smem = TmaSmemBytes(a);
    if (smem > 227 * 1024)
      return "chunk x warps: 2 stages of chunk bytes per warp must fit 227 KiB of shared memory, asked " +
             std::to_string(smem);
#else
    (void)device;
    return "mode push_tma: CUDA sm_90 only";
#endif
  }
  return "";
}

void LaunchLinkProbe(const LinkProbeArgs& a, gpuStream_t stream) {
  int device = 0;
  MORI_GPU_CHECK(gpuGetDevice(&device));
  const std::string problem = LinkProbeProblem(a, device);
  if (!problem.empty()) throw InvalidArgument("link probe: " + problem);
  ProbeParams p{};
  p.src = reinterpret_cast<const uint8_t*>(a.src);
  for (size_t t = 0; t < a.targets.size(); ++t) p.targets[t] = reinterpret_cast<uint8_t*>(a.targets[t]);
  p.local_dst = reinterpret_cast<uint8_t*>(a.local_dst);
  p.num_targets = static_cast<int>(a.targets.size());
  p.bytes = a.bytes;
  p.chunk = a.chunk;
  const int threads = a.warps * kWarpSize;
  switch (a.mode) {
    case LinkProbeMode::kPushAll:
      LinkProbe16<LinkProbeMode::kPushAll><<<a.blocks, threads, 0, stream>>>(p);
      break;
    case LinkProbeMode::kPushEach:
      LinkProbe16<LinkProbeMode::kPushEach><<<a.blocks, threads, 0, stream>>>(p);
      break;
    case LinkProbeMode::kPull:
      LinkProbe16<LinkProbeMode::kPull><<<a.blocks, threads, 0, stream>>>(p);
      break;
    case LinkProbeMode::kPushTma: {
      const size_t smem = TmaSmemBytes(a);
      if (smem > 48 * 1024) MORI_GPU_CHECK(gpuFuncSetMaxDynamicSmem(LinkProbeTma, static_cast<int>(smem)));
      LinkProbeTma<<<a.blocks, threads, smem, stream>>>(p);
      break;
    }
  }
  MORI_GPU_CHECK(gpuGetLastError());
}

}  // namespace mori::ccl
