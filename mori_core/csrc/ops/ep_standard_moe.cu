// Standard-MoE (DeepEP 3-D) layout kernels: the plan of dispatch_standard_moe,
// and the standalone converters convert_dispatch_output / convert_combine_input.
// Layout and ordering rules: ep_std_layout.cuh.
//
// dispatch_standard_moe, three-launch path (MORI_EP_STD_FUSED=0) =
// StdPlanKernel + DispatchKernel<_, kStdPlanned> + StdExpandKernel:
//   the plan sets one bit per (expert, token) of this rank, the last block turns
//   each expert's bitmap into per-word prefix counts and publishes the expert
//   totals to every rank (then a release flag); the dispatch sends every row once
//   per destination rank as a plain dispatch does, with each (row, k)'s position
//   among this rank's rows of that expert; the expand kernel on the receiving side
//   copies each received row to its final 3-D positions (earlier sources' counts +
//   that position), a local copy.
// The fused path (default) = DispatchKernel<_, kStdFused> + StdExpandKernel: the
//   dispatch kernel ranks the tokens and sends the counts itself (ep_dispatch.cu);
//   MORI_EP_STD_FUSED=2: DispatchKernel<_, kStdOneLaunch> alone, the expand
//   (StdExpandRows) as its tail.
// convert_dispatch_output = ConvertPlanKernel + ConvertScatterKernel on the
//   receiving side: the same bitmap ranking over (source rank, source token) of the
//   received rows, then one copy of each row per distinct local expert.
// convert_combine_input = ConvertCombineKernel: each received token's local expert
//   rows summed with its gating weights into the registered combine input.
#include "ops/ep_device_common.hpp"
#include "ops/ep_kernels.hpp"
#include "ops/ep_profiler.cuh"
#include "ops/ep_std_layout.cuh"

namespace mori::ep {
namespace dev {

__global__ void __launch_bounds__(kStdPlanThreads) StdPlanKernel(EpKernelArgs a, const int32_t* indices, int n) {
  extern __shared__ int32_t s_count[];  // [num_experts]
  __shared__ int s_flag;
  const EpGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  // Counts are published per dispatch round (peers index them by round parity); the token
  // bitmaps alternate per plan (see EpSyncState::std_plans).
  const uint32_t round = st->dispatch_epoch + 1, parity = st->std_plans & 1;
  MORI_PROF_BEGIN(a, kProfStdPlan, round);
  const int ne = g.num_experts, words = g.tok_words, nw = (n + 31) >> 5;
  uint32_t* bits = a.std.plan_bits + static_cast<size_t>(parity) * ne * words;
  uint32_t* other = a.std.plan_bits + static_cast<size_t>(parity ^ 1) * ne * words;
  const int gtid = blockIdx.x * blockDim.x + threadIdx.x, gthreads = gridDim.x * blockDim.x;
  // The other parity's bitmaps are set by the next round: clear the words its last use set.
  const int stale = st->plan_words[parity ^ 1];
  for (int i = gtid; i < ne * stale; i += gthreads) other[static_cast<size_t>(i / stale) * words + i % stale] = 0;
  for (int i = gtid; i < n * g.topk; i += gthreads) {
    const int e = indices[i], t = i / g.topk;
    if (e >= 0 && e < ne) atomicOr(bits + static_cast<size_t>(e) * words + (t >> 5), 1u << (t & 31));
  }
  MORI_PROF_END(a, kProfStdPlan, round);
  if (!ArriveLast(&st->plan_arrive, &s_flag)) return;
  MORI_PROF_BEGIN(a, kProfStdPlan, round);
  const int lane = LaneId(), warp = threadIdx.x / kWarpSize, nwarps = blockDim.x / kWarpSize;
  for (int e = warp; e < ne; e += nwarps) {
    const size_t off = static_cast<size_t>(e) * words;
    const int c = WarpScanBits(bits + off, a.std.plan_prefix + off, nw, lane);
    if (lane == 0) s_count[e] = c;
  }
  if (threadIdx.x == 0) {
    st->plan_words[parity] = nw;
    st->plan_words[parity ^ 1] = 0;
    st->std_plans += 1;  // every block read it at its start; the dispatch reads it after this kernel
  }
  __syncthreads();
  // Publish this rank's per-expert totals to every rank, then the round flag.
  int32_t* mine = a.buf.std_counts + (static_cast<size_t>(round & 1) * g.world + g.rank) * ne;
  for (int i = threadIdx.x; i < g.world * ne; i += blockDim.x) Peer(a, mine, i / ne)[i % ne] = s_count[i % ne];
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < g.world) {
    FenceSys();
    StoreReleaseSys(Peer(a, a.buf.std_flags + g.rank, threadIdx.x), round);
  }
  MORI_PROF_END(a, kProfStdPlan, round);
}

// dispatch_standard_moe, receiving side, right after the dispatch kernel: StdExpandRows.
__global__ void __launch_bounds__(kDispatchMaxThreads) StdExpandKernel(EpKernelArgs a, int row_bytes, bool planned) {
  extern __shared__ int32_t s_base[];  // [world][experts_per_rank]: rows of sources before s, per local expert
  const EpGeometry& g = a.geo;
  const uint32_t round = a.buf.sync->dispatch_epoch;  // requested with the failure flag
  if (OpFailed(a)) return;
  MORI_PROF_BEGIN(a, kProfStdExpand, round);
  const int tid = threadIdx.x;
  // Each source's plan published its counts (then fenced and released its flag) before the
  // dispatch that this rank's dispatch kernel waited for: the wait only bounds the check. The
  // fused dispatch sends them before its round signal, which that kernel waited for.
  bool ok = true;
  if (planned && tid < g.world) ok = WaitRound(a, a.buf.std_flags + tid, round, kPhaseDispatch, tid);
  if (!__syncthreads_and(ok)) return;
  StdExpandRows(a, row_bytes, round, s_base);
  MORI_PROF_END(a, kProfStdExpand, round);
}

// Key of a received row in the converter's bitmaps: source rank, then source
// token, each source on whole 32-bit words (so a source's rows start on a word).
__device__ __forceinline__ int ConvertKey(const EpGeometry& g, int32_t flat_src) {
  const int s = flat_src / g.max_send, t = flat_src - s * g.max_send;
  return s * g.tok_words * 32 + t;
}

__device__ __forceinline__ int LocalExpert(const EpGeometry& g, int e) {
  const int el = e - g.rank * g.experts_per_rank;
  return (e >= 0 && e < g.num_experts && el >= 0 && el < g.experts_per_rank) ? el : -1;
}

__global__ void __launch_bounds__(kStdPlanThreads) ConvertPlanKernel(EpKernelArgs a, const int32_t* ids, int x_rows) {
  __shared__ int s_flag;
  const EpGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const uint32_t round = st->dispatch_epoch;
  MORI_PROF_BEGIN(a, kProfConvertDispatch, round);
  int total = st->total_recv;
  if (total > x_rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0) ReportError(a, kErrConvertRows, kPhaseDispatch, -1, total, x_rows);
    total = 0;
  }
  const int words = g.world * g.tok_words;
  const int gtid = blockIdx.x * blockDim.x + threadIdx.x, gthreads = gridDim.x * blockDim.x;
  for (int i = gtid; i < total * g.topk; i += gthreads) {
    const int el = LocalExpert(g, ids[i]);
    if (el < 0) continue;
    const int key = ConvertKey(g, a.buf.src_pos[i / g.topk]);
    atomicOr(a.std.conv_bits + static_cast<size_t>(el) * words + (key >> 5), 1u << (key & 31));
  }
  MORI_PROF_END(a, kProfConvertDispatch, round);
  if (!ArriveLast(&st->plan_arrive, &s_flag)) return;
  const int lane = LaneId(), warp = threadIdx.x / kWarpSize, nwarps = blockDim.x / kWarpSize;
  for (int el = warp; el < g.experts_per_rank; el += nwarps) {
    const size_t off = static_cast<size_t>(el) * words;
    const int count = WarpScanBits(a.std.conv_bits + off, a.std.conv_prefix + off, words, lane);
    if (lane == 0) a.std.packed_count[el] = count;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < g.experts_per_rank * g.world; i += blockDim.x) {
    const int el = i / g.world, s = i % g.world;
    const int32_t* prefix = a.std.conv_prefix + static_cast<size_t>(el) * words;
    const int begin = prefix[s * g.tok_words];
    const int end = s + 1 < g.world ? prefix[(s + 1) * g.tok_words] : a.std.packed_count[el];
    a.std.layout_range[i] = static_cast<int64_t>(static_cast<uint32_t>(end - begin)) | (static_cast<int64_t>(begin) << 32);
  }
  if (threadIdx.x == 0) st->std_round = st->dispatch_epoch;
}

__global__ void __launch_bounds__(kDispatchMaxThreads) ConvertScatterKernel(EpKernelArgs a, const uint8_t* x,
                                                                            int row_bytes, int x_rows,
                                                                            const int32_t* ids) {
  const EpGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  MORI_PROF_BEGIN(a, kProfConvertDispatch, st->dispatch_epoch);
  const int total = min(st->total_recv, x_rows), vecs = row_bytes / 16, lane = LaneId(), words = g.world * g.tok_words;
  const int nwarps = blockDim.x / kWarpSize;
  const int gwarp = blockIdx.x * nwarps + threadIdx.x / kWarpSize, total_warps = gridDim.x * nwarps;
  int parts = max(1, total_warps / max(total, 1));
  parts = min(parts, max(1, vecs / kWarpSize));
  const int vpp = (vecs + parts - 1) / parts;
  for (int item = gwarp; item < total * parts; item += total_warps) {
    const int i = item % total, part = item / total;
    const int32_t flat = a.buf.src_pos[i];
    // lane k: packed row of entry k (-1: not a local expert), dup = repeats an earlier expert
    const int e = lane < g.topk ? ids[static_cast<size_t>(i) * g.topk + lane] : -1;
    const int el = lane < g.topk ? LocalExpert(g, e) : -1;
    bool dup = false;
    for (int j = 0; j < g.topk; ++j) {
      const int ej = ShflIdx(e, j);  // every lane shuffles (no short-circuit around it)
      dup |= j < lane && ej == e;
    }
    int row = -1;
    if (el >= 0) {
      const size_t off = static_cast<size_t>(el) * words;
      row = el * g.tpe + BitRank(a.std.conv_bits + off, a.std.conv_prefix + off, ConvertKey(g, flat));
    }
    if (part == 0) {
      if (lane < g.topk) a.std.std_row[static_cast<size_t>(i) * g.topk + lane] = row;
      if (row >= 0 && !dup) a.std.packed_src_info[row] = flat;
      if (g.scale_bytes > 0) {
        for (int k = 0; k < g.topk; ++k) {
          const int rk = ShflIdx(row, k), dk = ShflIdx(dup ? 1 : 0, k);
          if (rk < 0 || dk) continue;
          CopySmall(a.std.packed_scales + static_cast<size_t>(rk) * g.scale_bytes,
                    a.buf.dispatch_out_scales + static_cast<size_t>(i) * g.scale_bytes, g.scale_bytes, lane);
        }
      }
    }
    const int4* src = reinterpret_cast<const int4*>(x + static_cast<size_t>(i) * row_bytes);
    const int v1 = min(vecs, (part + 1) * vpp);
    constexpr int kUnroll = 4;
    for (int v0 = part * vpp; v0 < v1; v0 += kWarpSize * kUnroll) {
      int4 xv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + lane + u * kWarpSize;
        if (v < v1) xv[u] = LoadStream(src + v);
      }
      for (int k = 0; k < g.topk; ++k) {
        const int rk = ShflIdx(row, k), dk = ShflIdx(dup ? 1 : 0, k);
        if (rk < 0 || dk) continue;
        int4* dst = reinterpret_cast<int4*>(a.std.packed_x + static_cast<size_t>(rk) * row_bytes);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = v0 + lane + u * kWarpSize;
          if (v < v1) Store16(dst + v, xv[u]);
        }
      }
    }
  }
  MORI_PROF_END(a, kProfConvertDispatch, st->dispatch_epoch);
}

template <typename Tag>
__global__ void __launch_bounds__(kCombineMaxThreads) ConvertCombineKernel(EpKernelArgs a, const uint8_t* packed,
                                                                           int row_bytes) {
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  MORI_PROF_BEGIN(a, kProfConvertCombine, st->dispatch_epoch);
  if (st->std_round != st->dispatch_epoch) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      ReportError(a, kErrStdStale, kPhaseCombine, -1, st->std_round, st->dispatch_epoch);
    return;
  }
  const int total = st->total_recv, vecs = row_bytes / 16, lane = LaneId();
  const int nwarps = blockDim.x / kWarpSize;
  const int gwarp = blockIdx.x * nwarps + threadIdx.x / kWarpSize, total_warps = gridDim.x * nwarps;
  const bool weighted = st->dispatch_weighted != 0;
  int parts = max(1, total_warps / max(total, 1));
  parts = min(parts, max(1, vecs / kWarpSize));
  const int vpp = (vecs + parts - 1) / parts;
  for (int item = gwarp; item < total * parts; item += total_warps) {
    const int i = item % total, part = item / total;
    StdReduceRow<Tag, kQuantNone>(a, packed, row_bytes, i, weighted,
                                  a.buf.combine_inp + static_cast<size_t>(i) * row_bytes, false, part * vpp,
                                  min(vecs, (part + 1) * vpp), lane);
  }
  MORI_PROF_END(a, kProfConvertCombine, st->dispatch_epoch);
}

}  // namespace dev

void LaunchStdPlan(const EpKernelArgs& args, const int32_t* indices, int num_tokens, int blocks, gpuStream_t stream) {
  const size_t smem = sizeof(int32_t) * static_cast<size_t>(args.geo.num_experts);
  dev::StdPlanKernel<<<blocks, kStdPlanThreads, smem, stream>>>(args, indices, num_tokens);
  MORI_GPU_CHECK(gpuGetLastError());
}

void LaunchStdExpand(const EpKernelArgs& args, int row_bytes, bool planned, int blocks, int warps,
                     gpuStream_t stream) {
  // world x experts_per_rank ints: at most 8 x 256 (the handle checks the expert count), under 48 KiB.
  const size_t smem = sizeof(int32_t) * static_cast<size_t>(args.geo.world) * args.geo.experts_per_rank;
  dev::StdExpandKernel<<<blocks, warps * dev::kWarpSize, smem, stream>>>(args, row_bytes, planned);
  MORI_GPU_CHECK(gpuGetLastError());
}

void LaunchConvertDispatch(const EpKernelArgs& args, const uint8_t* x, int row_bytes, int x_rows, const int32_t* ids,
                           int blocks, int warps, gpuStream_t stream) {
  const size_t bitmap_bytes = sizeof(uint32_t) * static_cast<size_t>(args.geo.experts_per_rank) * args.geo.world *
                              args.geo.tok_words;
  MORI_GPU_CHECK(gpuMemsetAsync(args.std.conv_bits, 0, bitmap_bytes, stream));
  dev::ConvertPlanKernel<<<blocks, kStdPlanThreads, 0, stream>>>(args, ids, x_rows);
  MORI_GPU_CHECK(gpuGetLastError());
  dev::ConvertScatterKernel<<<blocks, warps * dev::kWarpSize, 0, stream>>>(args, x, row_bytes, x_rows, ids);
  MORI_GPU_CHECK(gpuGetLastError());
}

void LaunchConvertCombine(const EpKernelArgs& args, const uint8_t* packed, int row_bytes, CombineDtype dtype,
                          int blocks, int warps, gpuStream_t stream) {
  const int threads = warps * dev::kWarpSize;
  if (dtype == CombineDtype::kBf16)
    dev::ConvertCombineKernel<dev::Bf16Tag><<<blocks, threads, 0, stream>>>(args, packed, row_bytes);
  else
    dev::ConvertCombineKernel<float><<<blocks, threads, 0, stream>>>(args, packed, row_bytes);
  MORI_GPU_CHECK(gpuGetLastError());
}

}  // namespace mori::ep
