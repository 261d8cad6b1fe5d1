// IntraNode combine: return expert outputs to the ranks their tokens came from
// and sum them per original token in fp32.
//
// Push (use_external_inp_buf=1): every received row i is written into its
//   source rank's staging slot [this rank][source token]; one barrier; then each
//   rank reduces its own tokens from local staging (its own rows are read in
//   place from `input`).
// Pull (use_external_inp_buf=0, zero-copy): the expert outputs already sit in
//   this rank's registered buffer; one barrier; each rank reads the rows of its
//   tokens straight from the destination ranks' registered buffers over NVLink.
// The barrier is "last block signals round to every peer, every block waits
// for every peer's round", so the grid must be co-resident (the launcher clamps
// it). No trailing barrier is needed: a peer may only overwrite what we read
// after its next dispatch completes, which needs our next dispatch signal.
#pragma once

#include "ops/ep_device_common.hpp"
#include "ops/ep_kernels.hpp"
#include "shmem/gpu_ext.hpp"

namespace mori::ep {
namespace dev {

constexpr int kCopyUnroll = 8;  // push rows: one destination each, so keep more loads in flight

template <typename Tag, int kWorld>
struct CombineShape {
  static constexpr int kElems = VecTraits<Tag>::kElems;
  // Rows loaded per lane before accumulating: keep 16 vectors and 32 fp32
  // accumulators per thread (fits 128 registers at 512 threads).
  static constexpr int kU0 = 16 / kWorld < 32 / kElems ? 16 / kWorld : 32 / kElems;
  static constexpr int kUnroll = kU0 < 1 ? 1 : kU0;
};

// Work split of `count` rows over all warps of the grid: rows are cut into
// `parts` slices when there are fewer rows than warps.
struct RowSplit {
  int parts, vpp, items;
  __device__ RowSplit(int count, int total_warps, int vecs) {
    parts = max(1, total_warps / max(count, 1));
    parts = min(parts, max(1, vecs / kWarpSize));
    vpp = (vecs + parts - 1) / parts;
    items = count * parts;
  }
};

template <typename Tag, int kWorld, bool kPush>
__global__ void __launch_bounds__(kCombineMaxThreads) CombineKernel(EpKernelArgs a, CombineParams p) {
  using VT = VecTraits<Tag>;
  constexpr int kE = VT::kElems;
  constexpr int kU = CombineShape<Tag, kWorld>::kUnroll;
  __shared__ int s_flag;
  const EpGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const uint32_t round = st->combine_epoch + 1;
  // The previous launch used the other queue and has completed: clear it for the next one.
  if (blockIdx.x == 0 && threadIdx.x == 0) st->combine_items[(round + 1) & 1] = 0;
  const int world = g.world, vecs = p.row_bytes / 16, lane = LaneId();
  const int nwarps = blockDim.x / kWarpSize;
  const int gwarp = blockIdx.x * nwarps + threadIdx.x / kWarpSize, total_warps = gridDim.x * nwarps;
  int total = st->total_recv;
  bool use_w = p.weights != nullptr;
  const bool rows_ok = !p.check_input_rows || total <= p.input_rows;
  if (!rows_ok) {
    if (blockIdx.x == 0 && threadIdx.x == 0) ReportError(a, kErrCombineRows, kPhaseCombine, -1, total, p.input_rows);
    total = 0;
  }
  if (use_w && total > p.weight_rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0) ReportError(a, kErrCombineWeightRows, kPhaseCombine, -1, total, p.weight_rows);
    use_w = false;
  }

  // Phase 0: push rows to their sources (push) / stage weights for peers (pull).
  if (kPush) {
    const RowSplit sp(total, total_warps, vecs);
    for (int item = gwarp; item < sp.items; item += total_warps) {
      const int i = item % total, part = item / total;
      const int pos = a.buf.src_pos[i];
      const int s = pos / g.max_send, t = pos - s * g.max_send;
      if (s == g.rank) continue;  // own rows are read in place by the reduce
      const size_t stage_row = static_cast<size_t>(g.rank) * g.max_tok + t;
      int4* dst = reinterpret_cast<int4*>(Peer(a, a.buf.stage, s) + stage_row * p.row_bytes);
      const int4* src = reinterpret_cast<const int4*>(p.input + static_cast<size_t>(i) * p.row_bytes);
      const int v1 = min(vecs, (part + 1) * sp.vpp);
      for (int v = part * sp.vpp + lane; v < v1; v += kWarpSize * kCopyUnroll) {
        int4 x[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
          if (v + u * kWarpSize < v1) x[u] = LoadStream(src + v + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
          if (v + u * kWarpSize < v1) Store16(dst + v + u * kWarpSize, x[u]);
      }
      if (part == 0 && use_w && lane < g.topk)
        Peer(a, a.buf.stage_weights, s)[stage_row * g.topk + lane] = p.weights[static_cast<size_t>(i) * g.topk + lane];
    }
  } else if (use_w && !p.weights_symmetric) {
    const int n = total * g.topk;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
      a.buf.combine_inp_weights[i] = p.weights[i];
  }

  // Barrier with every peer.
  if (ArriveLast(&st->combine_arrive, &s_flag)) {
    if (static_cast<int>(threadIdx.x) < world) {
      FenceSys();
      StoreReleaseSys(Peer(a, a.buf.combine_flags + g.rank, threadIdx.x), round);
    }
    if (threadIdx.x == 0) st->combine_epoch = round;
  }
  bool ok = true;
  if (static_cast<int>(threadIdx.x) < world)
    ok = WaitRound(a, a.buf.combine_flags + threadIdx.x, round, kPhaseCombine, threadIdx.x);
  if (!__syncthreads_and(ok) || !rows_ok) return;

  // Phase 1: out[t] = sum over t's destination ranks of their row for t (fp32).
  const int n = p.num_tokens;
  const RowSplit sp(n, total_warps, vecs);
  // Every warp starts with its own item; when there are more items than warps
  // the rest come from a grid-wide queue (tokens have 1..world sources, so a
  // static split finishes unevenly). The next item is fetched while the
  // current one is processed. Few items: no queue, so no atomic contention.
  int32_t* queue = &st->combine_items[round & 1];
  const bool use_queue = sp.items > total_warps;
  int item = gwarp;
  while (item < sp.items) {
    int next = sp.items;
    if (use_queue && lane == 0) next = total_warps + atomicAdd(queue, 1);
    const int t = item % n, part = item / n;
    uint32_t bit = 0;
    if (lane < g.topk) {
      const int e = p.indices[static_cast<size_t>(t) * g.topk + lane];
      if (e >= 0 && e < g.num_experts) bit = 1u << (e / g.experts_per_rank);
    }
    const uint32_t routed = WarpOr(bit);
    const uint32_t sent = a.buf.token_mask[t];
    if (routed != sent && part == 0 && lane == 0)
      ReportError(a, kErrRoutingMismatch, kPhaseCombine, -1, t, (static_cast<int64_t>(routed) << 32) | sent);
    const int4* src[kWorld];
    int slot_of[kWorld];
    bool on[kWorld];
#pragma unroll
    for (int r = 0; r < kWorld; ++r) {
      slot_of[r] = (r < world && ((sent >> r) & 1u)) ? a.buf.dest_slot[static_cast<size_t>(t) * world + r] : -1;
      on[r] = slot_of[r] >= 0;
      const size_t slot = static_cast<size_t>(max(slot_of[r], 0));
      if (kPush)
        src[r] = reinterpret_cast<const int4*>(
            r == g.rank ? p.input + slot * p.row_bytes
                        : a.buf.stage + (static_cast<size_t>(r) * g.max_tok + t) * p.row_bytes);
      else
        src[r] = reinterpret_cast<const int4*>(Peer(a, a.buf.combine_inp, r) + slot * p.row_bytes);
    }
    int4* dst = reinterpret_cast<int4*>(a.buf.combine_out + static_cast<size_t>(t) * p.row_bytes);
    const int v1 = min(vecs, (part + 1) * sp.vpp);
    for (int v = part * sp.vpp + lane; v < v1; v += kWarpSize * kU) {
      int4 x[kWorld][kU];
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        if (!on[r]) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (v + u * kWarpSize < v1) x[r][u] = LoadPeer(src[r] + v + u * kWarpSize);
      }
      float acc[kU][kE];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[u][e] = 0.f;
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        if (!on[r]) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (v + u * kWarpSize < v1) VT::Accumulate(acc[u], x[r][u]);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (v + u * kWarpSize < v1) Store16(dst + v + u * kWarpSize, VT::Pack(acc[u]));
    }
    if (part == 0 && use_w && lane < g.topk) {
      float w = 0.f;
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        if (!on[r]) continue;
        const size_t slot = static_cast<size_t>(slot_of[r]);
        if (kPush)
          w += r == g.rank ? p.weights[slot * g.topk + lane]
                           : a.buf.stage_weights[(static_cast<size_t>(r) * g.max_tok + t) * g.topk + lane];
        else
          w += (p.weights_symmetric ? Peer(a, a.buf.dispatch_out_weights, r)
                                    : Peer(a, a.buf.combine_inp_weights, r))[slot * g.topk + lane];
      }
      a.buf.combine_out_weights[static_cast<size_t>(t) * g.topk + lane] = w;
    }
    item = use_queue ? ShflIdx(next, 0) : sp.items;
  }
}

template <typename Tag, int kWorld, bool kPush>
void Launch(const EpKernelArgs& args, const CombineParams& params, int blocks, int threads, gpuStream_t stream) {
  CombineKernel<Tag, kWorld, kPush><<<blocks, threads, 0, stream>>>(args, params);
}

template <typename Tag, int kWorld, bool kPush>
int MaxBlocksPerSm(int threads) {
  int n = 0;
  MORI_GPU_CHECK(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&n, CombineKernel<Tag, kWorld, kPush>, threads, 0));
  return n;
}

template <typename Tag, int kWorld>
int MaxBlocksPerSmFor(bool push, int threads) {
  return push ? MaxBlocksPerSm<Tag, kWorld, true>(threads) : MaxBlocksPerSm<Tag, kWorld, false>(threads);
}


// Instantiated once per dtype (ep_combine_bf16.cu, ep_combine_fp32.cu) so the
// two translation units compile in parallel.
template <typename Tag>
void LaunchCombineFor(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                      gpuStream_t stream) {
  const int w = args.geo.world <= 2 ? 2 : (args.geo.world <= 4 ? 4 : 8);
  if (w == 2)
    push ? Launch<Tag, 2, true>(args, params, blocks, threads, stream) : Launch<Tag, 2, false>(args, params, blocks, threads, stream);
  else if (w == 4)
    push ? Launch<Tag, 4, true>(args, params, blocks, threads, stream) : Launch<Tag, 4, false>(args, params, blocks, threads, stream);
  else
    push ? Launch<Tag, 8, true>(args, params, blocks, threads, stream) : Launch<Tag, 8, false>(args, params, blocks, threads, stream);
}

template <typename Tag>
int MaxBlocksPerSmForWorld(int world, bool push, int threads) {
  const int w = world <= 2 ? 2 : (world <= 4 ? 4 : 8);
  return w == 2 ? MaxBlocksPerSmFor<Tag, 2>(push, threads)
                : (w == 4 ? MaxBlocksPerSmFor<Tag, 4>(push, threads) : MaxBlocksPerSmFor<Tag, 8>(push, threads));
}

void LaunchCombineBf16(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                       gpuStream_t stream);
void LaunchCombineFp32(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                       gpuStream_t stream);
int CombineBlocksPerSmBf16(int world, bool push, int threads);
int CombineBlocksPerSmFp32(int world, bool push, int threads);

}  // namespace dev
}  // namespace mori::ep
