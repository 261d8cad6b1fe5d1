// IntraNode combine: return expert outputs to the ranks their tokens came from
// and sum them per original token in fp32.
//
// Push (kCombinePush): every received row i is written into its source rank's
//   staging slot [this rank][source token]; then each rank reduces its own tokens
//   from local staging (its own rows are read in place from `input`). Each warp
//   pushes a contiguous run of received rows (WarpRun), so at every moment a rank
//   writes to all its sources, not to the one whose rows happen to come first.
//   Small batches: push everything, one barrier, reduce. Staged (a source has more
//   than `stage_tokens` tokens): each source's tokens are cut into chunks, every
//   rank pushes its rows chunk by chunk and signals each chunk to every rank; some
//   blocks only reduce, chunk k as soon as every rank signalled it, while chunk k+1
//   is still crossing the links (push and reduce overlap, as DeepEP's sender and
//   receiver blocks do). Overlapped (large rounds, MORI_EP_PUSH_OVERLAP): no chunks;
//   each warp flags every row it pushed to the row's source right after it
//   (push_rows[this rank][t] = round), and reducer blocks sum each token as soon as
//   its rows are flagged, while the rest is still in flight; a chunk-wide arrival
//   would let the slowest pusher set the pace. Every block waits for every rank's
//   "all pushed" signal before it exits (see PushCombine).
// Pull (kCombinePull, zero-copy): the expert outputs already sit in this rank's
//   registered buffer; one barrier; each rank reads the rows of its tokens straight
//   from the destination ranks' registered buffers over NVLink. Pull-or-push
//   (kCombinePullOrPush, what a pull call gets): the same, except that a small round
//   (every source dispatched at most pull_push_tokens tokens) pushes the registered
//   rows, as the push kernel would (kSmallPush).
// Copy-pull (kCombineCopyPull): the caller's rows are first copied into the
//   registered buffer (a local copy), then as pull.
// FP8 transport (quant_type, bf16 rows only; ep_quant.cuh): every row the combine
//   moves is e4m3 (+ block scales), a rank's own rows included (as MORI, whose
//   own rows also pass through the staging buffers): push quantises while pushing
//   (own rows into local staging); pull quantises this rank's registered rows into
//   its staging buffer before the barrier and every rank reads those.
// Standard MoE (combine_standard_moe, push only): `input` is the 3-D
//   [local expert][row][hidden] layout; phase 0 sums each received token's
//   expert rows weighted by its gating weights (fp32, rounded to the row dtype)
//   while pushing it, own tokens included (into local staging).
// The barriers are per-source arrival counters (kArriveShift, #31 round 9): every
// block that took part adds its share of the round to its rank's counter on every
// peer, and every block waits until every peer's counter has reached the round,
// so the grid must be co-resident (the launcher clamps it). A round adds one round
// of units to every combine counter of every rank: block 0 pads the counters the
// round did not use (PadUnusedCombineCounters), once its own waits are over, so
// that two ranks running different kinds of combine in one round wait for each
// other until the timeout instead of passing. No trailing barrier is needed: a peer
// may only overwrite what we read after its next dispatch completes, which needs
// our next dispatch's arrival.
#pragma once

#include <algorithm>
#include <type_traits>

#include "ops/ep_device_common.hpp"
#include "ops/ep_kernels.hpp"
#include "ops/ep_profiler.cuh"
#include "ops/ep_quant.cuh"
#include "ops/ep_std_layout.cuh"
#include "shmem/gpu_ext.hpp"

namespace mori::ep {
namespace dev {

constexpr int kCopyUnroll = 8;  // push rows: one destination each, so keep more loads in flight

#ifndef MORI_EP_FP8_UNROLL
#define MORI_EP_FP8_UNROLL 8
#endif

template <typename Tag, int kWorld>
struct CombineShape {
  static constexpr int kElems = VecTraits<Tag>::kElems;
  // Rows loaded per lane before accumulating: keep 16 vectors and 32 fp32
  // accumulators per thread (fits 128 registers at 512 threads).
  static constexpr int kU0 = 16 / kWorld < 32 / kElems ? 16 / kWorld : 32 / kElems;
  static constexpr int kUnroll = kU0 < 1 ? 1 : kU0;
  // FP8 rows: an e4m3 vector, its block scale and the decode need more registers per vector.
  // MORI_EP_FP8_UNROLL (a build-time knob for A/B runs) is the numerator: vectors per lane
  // in flight = MORI_EP_FP8_UNROLL / world. 16 measured within noise of 8 at EP4 x 4096 and
  // spills in the blockwise overlapped kernel at EP2, so 8 stays.
  static constexpr int kFp8Unroll = MORI_EP_FP8_UNROLL / kWorld < 1 ? 1 : MORI_EP_FP8_UNROLL / kWorld;
};

// Work split of `count` rows over all warps of the grid: rows are cut into
// `parts` slices when there are fewer rows than warps. Slices are multiples of
// `align` vectors (FP8 blocks must not straddle two warps).
struct RowSplit {
  int parts, vpp, items;
  __device__ RowSplit(int count, int total_warps, int vecs, int align = 1) {
    parts = max(1, total_warps / max(count, 1));
    parts = min(parts, max(1, vecs / (align > kWarpSize ? align : kWarpSize)));
    vpp = (vecs + parts - 1) / parts;
    vpp = (vpp + align - 1) / align * align;
    items = count * parts;
  }
};

// Quantises vectors [v0b, v1) of a bf16 row into an FP8 row (warp-uniform loop:
// blockwise scales need every lane in the shuffles).
template <int kQuant>
__device__ __forceinline__ void QuantizeRow(const int4* src, uint8_t* dst_row, int row_bytes, int v0b, int v1, int lane) {
  using VT = VecTraits<Bf16Tag>;
  constexpr int kU = 8;  // vectors per lane in flight (only the loads are held across the loop)
  for (int v0 = v0b; v0 < v1; v0 += kWarpSize * kU) {
    int4 x[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + lane + u * kWarpSize;
      if (v < v1) x[u] = LoadStream(src + v);
    }
    float sc[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + lane + u * kWarpSize;
      float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (v < v1) VT::Unpack(x[u], f);
      sc[u] = Fp8QuantStore<kQuant>(f, v < v1, dst_row, row_bytes, v);
    }
    Fp8StoreScales<kQuant>(sc, dst_row, row_bytes, v0, v1, lane);
  }
}

// Reduce step of one lane: sums in fp32, in rank order, the rows of the sources
// that are `on`, for its vectors v + u * kWarpSize (u < kU, those below v1), and
// stores them rounded once to the row dtype. `add(acc, r, u)` adds source r's
// vector u, which the caller has already loaded (all loads in flight first).
// The accumulators are the caller's, declared next to its loads: an array
// local to this helper changes how the kernel's registers are allocated.
template <typename Tag, int kWorld, int kU, typename Add>
__device__ __forceinline__ void SumSources(float (&acc)[kU][VecTraits<Tag>::kElems], int4* dst,
                                           const bool (&on)[kWorld], int v, int v1, Add add) {
  using VT = VecTraits<Tag>;
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int e = 0; e < VT::kElems; ++e) acc[u][e] = 0.f;
#pragma unroll
  for (int r = 0; r < kWorld; ++r) {
    if (!on[r]) continue;
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (v + u * kWarpSize < v1) add(acc[u], r, u);
  }
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (v + u * kWarpSize < v1) Store16(dst + v + u * kWarpSize, VT::Pack(acc[u]));
}

// ---------------------------------------------------------------------------------------------
// Staged push: a source's n tokens are cut into PushStages(n) chunks of equal size (the same
// rule on the pushing and the reducing side, both knowing n from the dispatch).
__device__ __forceinline__ int PushStages(int n, int stage_tokens) {
  if (stage_tokens <= 0 || n <= stage_tokens) return 1;
  return min(kMaxPushStages, (n + stage_tokens - 1) / stage_tokens);
}
__device__ __forceinline__ int PushStageTokens(int n, int stages) { return max(1, (n + stages - 1) / stages); }

// Push mode, one item: vectors [part * vpp, ...) of received row i, whose source is (s, t), into
// the source's staging slot [this rank][t] (summed from the 3-D layout for standard MoE,
// FP8-quantised for quant_type), and its gating weights.
template <typename Tag, int kQuant, bool kStd>
__device__ __forceinline__ void PushItem(const EpKernelArgs& a, const CombineParams& p, int i, int part, int vpp,
                                         int vecs, int s, int t, bool weighted, bool use_w, int lane) {
  const EpGeometry& g = a.geo;
  const size_t stage_row = static_cast<size_t>(g.rank) * g.max_tok + t;
  uint8_t* dst_row = Peer(a, a.buf.stage, s) + stage_row * p.row_bytes;
  const int v0b = part * vpp, v1 = min(vecs, v0b + vpp);
  if constexpr (kStd) {
    StdReduceRow<Tag, kQuant>(a, p.input, p.row_bytes, i, weighted, dst_row, kQuant != kQuantNone, v0b, v1, lane);
  } else {
    const int4* src = reinterpret_cast<const int4*>(p.input + static_cast<size_t>(i) * p.row_bytes);
    if constexpr (kQuant != kQuantNone) {
      QuantizeRow<kQuant>(src, dst_row, p.row_bytes, v0b, v1, lane);
    } else {
      int4* dst = reinterpret_cast<int4*>(dst_row);
      for (int v = v0b + lane; v < v1; v += kWarpSize * kCopyUnroll) {
        int4 x[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
          if (v + u * kWarpSize < v1) x[u] = LoadStream(src + v + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
          if (v + u * kWarpSize < v1) Store16(dst + v + u * kWarpSize, x[u]);
      }
    }
  }
  if (part == 0 && use_w && lane < g.topk)
    Peer(a, a.buf.stage_weights, s)[stage_row * g.topk + lane] = p.weights[static_cast<size_t>(i) * g.topk + lane];
}

// Reduce, one item: vectors [part * vpp, ...) of out[t] = sum over t's destination ranks of their
// row for t (fp32, ascending rank order, rounded once), and (part 0) the summed weights. Push
// reads local staging (its own rows in place from `input` unless staged); pull reads the
// destinations' registered buffers (FP8: their staging), its own rows from `input` when the
// copy-pull mode left them there (own_in_input).
template <typename Tag, int kWorld, bool kPush, int kQuant>
__device__ __forceinline__ void ReduceItem(const EpKernelArgs& a, const CombineParams& p, int t, int part, int vpp,
                                           int vecs, bool staged, bool own_in_input, bool use_w, int lane) {
  using VT = VecTraits<Tag>;
  constexpr int kE = VT::kElems;
  constexpr int kU = CombineShape<Tag, kWorld>::kUnroll;
  const EpGeometry& g = a.geo;
  const int world = g.world;
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
  bool on[kWorld];
#pragma unroll
  for (int r = 0; r < kWorld; ++r) {
    const int slot_r = (r < world && ((sent >> r) & 1u)) ? a.buf.dest_slot[static_cast<size_t>(t) * world + r] : -1;
    on[r] = slot_r >= 0;
    const size_t slot = static_cast<size_t>(max(slot_r, 0));
    const uint8_t* row;
    if (kPush) {
      if (r == g.rank && !staged)
        row = p.input + slot * p.row_bytes;
      else
        row = a.buf.stage + (static_cast<size_t>(r) * g.max_tok + t) * p.row_bytes;
    } else if (r == g.rank && own_in_input) {
      row = p.input + slot * p.row_bytes;
    } else {
      row = Peer(a, kQuant != kQuantNone ? a.buf.stage : a.buf.combine_inp, r) + slot * p.row_bytes;
    }
    src[r] = reinterpret_cast<const int4*>(row);
  }
  int4* dst = reinterpret_cast<int4*>(a.buf.combine_out + static_cast<size_t>(t) * p.row_bytes);
  const int v1 = min(vecs, (part + 1) * vpp);
  if constexpr (kQuant == kQuantNone) {
    for (int v = part * vpp + lane; v < v1; v += kWarpSize * kU) {
      int4 x[kWorld][kU];
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        if (!on[r]) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (v + u * kWarpSize < v1) x[r][u] = LoadPeer(src[r] + v + u * kWarpSize);
      }
      float acc[kU][kE];
      SumSources<Tag, kWorld, kU>(acc, dst, on, v, v1, [&](float (&a)[kE], int r, int u) { VT::Accumulate(a, x[r][u]); });
    }
  } else {
    // Every source's row in e4m3 (+ block scales); summed in rank order.
    constexpr int kQU = CombineShape<Tag, kWorld>::kFp8Unroll;
    for (int v = part * vpp + lane; v < v1; v += kWarpSize * kQU) {
      uint2 q[kWorld][kQU];
      float sc[kWorld][kQU];
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        if (!on[r]) continue;
        const float* scales = Fp8RowScales(reinterpret_cast<const uint8_t*>(src[r]), p.row_bytes);
#pragma unroll
        for (int u = 0; u < kQU; ++u) {
          const int vv = v + u * kWarpSize;
          if (vv < v1) {
            q[r][u] = LoadPeer8(reinterpret_cast<const uint2*>(src[r]) + vv);
            sc[r][u] = kQuant == kQuantFp8Block ? LoadPeerF(scales + vv / kFp8BlockVecs) : 1.f;
          }
        }
      }
      float acc[kQU][kE];
      SumSources<Tag, kWorld, kQU>(acc, dst, on, v, v1, [&](float (&a)[kE], int r, int u) {
        Fp8Accumulate<kQuant>(a, q[r][u].x, q[r][u].y, sc[r][u]);
      });
    }
  }
  if (part == 0 && use_w && lane < g.topk) {
    float w = 0.f;
#pragma unroll
    for (int r = 0; r < kWorld; ++r) {
      if (!on[r]) continue;
      const size_t slot = static_cast<size_t>(a.buf.dest_slot[static_cast<size_t>(t) * world + r]);
      if (kPush)
        w += r == g.rank && !staged ? p.weights[slot * g.topk + lane]
                                    : a.buf.stage_weights[(static_cast<size_t>(r) * g.max_tok + t) * g.topk + lane];
      else
        w += Peer(a, a.buf.combine_inp_weights, r)[slot * g.topk + lane];
    }
    a.buf.combine_out_weights[static_cast<size_t>(t) * g.topk + lane] = w;
  }
}

// The items of one warp when `items` are cut into contiguous runs, one per warp (of `warps`).
// Used for pushing: warps then work on rows spread over the whole receive order at every moment,
// so every rank writes to all of its sources at once. Rows of one source arrive in runs (and a
// rank that starts its dispatch first owns the first slots everywhere); a grid-strided loop
// would have every warp of every rank write to the same source at the same time (incast), with
// that source's links saturated and the others idle.
struct WarpRun {
  int begin, end;
  __device__ WarpRun(int items, int warp, int warps) {
    const int q = (items + warps - 1) / max(warps, 1);
    begin = min(items, warp * q);
    end = min(items, begin + q);
  }
};

// Pushers' arrival after chunk k: each pusher block (of P, blocks [0, P)) adds its share of the
// round to this rank's chunk-k counter on every rank.
__device__ __forceinline__ void SignalPushed(const EpKernelArgs& a, int k, int P) {
  ArriveAtPeers(a, a.buf.push_flags + k * kMaxWorld + a.geo.rank, a.geo.world, P);
}

// Block 0, once this rank's waits of the round are over: every combine arrival counter of this
// rank that the round did not use (the pull counter in a push round, the chunks from `stages` on;
// every push chunk in a pull round) gets one round of units on every rank, so that every counter
// advances by one round per combine round and the waits can compare it with the round number.
// After the waits, so that a rank whose peer ran the other kind of combine in this round is never
// released by the peer's padding: each waits for an arrival the other sends only after its own wait.
// `stage_tokens`: the push's chunk size (CombineParams::stage_tokens); the chunk count is computed
// again here, as at the kernel's start, rather than kept live through the reduce (registers).
__device__ __forceinline__ void PadUnusedCombineCounters(const EpKernelArgs& a, bool pull_round, int stage_tokens) {
  const int world = a.geo.world, rank = a.geo.rank;
  int stages = 0;
  if (!pull_round) {
    const int32_t* ntok = a.buf.peer_tokens + (a.buf.sync->dispatch_epoch & 1) * kMaxWorld;
    stages = 1;
    for (int s = 0; s < world; ++s) stages = max(stages, PushStages(ntok[s], stage_tokens));
  }
  const int n = (1 + kMaxPushStages) * world;  // counter c: 0 the pull counter, 1 + k push chunk k
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int c = i / world, r = i - c * world;
    if (pull_round ? c == 0 : (c >= 1 && c - 1 < stages)) continue;
    uint32_t* counter = c == 0 ? a.buf.combine_flags + rank : a.buf.push_flags + (c - 1) * kMaxWorld + rank;
    RedAddSys(Peer(a, counter, r), 1u << kArriveShift);
  }
}

// Overlapped push, reduce side: reduce warp `rw` (of RW) sums the tokens t = rw + j * RW, each as
// soon as every row it waits for is flagged (push_rows[r][t] == round), in whatever order they
// become ready: a row's arrival time depends on where it sits in its destination's push order,
// not on t. Lanes poll one token each (a window of kWarpSize at a time), the warp reduces the ready
// ones. Bounded: no progress within the op timeout reports the rank whose row is missing.
template <typename Tag, int kWorld, int kQuant>
__device__ __forceinline__ bool ReduceWhenPushed(const EpKernelArgs& a, const CombineParams& p, uint32_t round,
                                                 int rw, int RW, bool staged, bool use_w, int lane) {
  const EpGeometry& g = a.geo;
  const int n = p.num_tokens, vecs = p.row_bytes / 16;
  for (int w0 = rw; w0 < n; w0 += RW * kWarpSize) {
    LaneMask pending = Ballot(w0 + lane * RW < n);
    uint64_t since = GlobalTimerNs();
    uint32_t sleep_ns = 0;
    while (pending != 0) {
      // Polled afresh every time: nothing but `pending` lives across the reduce below.
      const int t = w0 + lane * RW;
      const bool mine = ((pending >> lane) & 1) != 0;
      uint32_t need = mine ? a.buf.token_mask[t] & ((1u << g.world) - 1u) : 0u;
      if (!staged) need &= ~(1u << g.rank);  // own rows in place need no wait
      for (uint32_t m = need; m != 0; m &= m - 1) {
        const int r = __ffs(m) - 1;
        if (ReachedRound(LoadAcquireSys(a.buf.push_rows + static_cast<size_t>(r) * g.max_tok + t), round))
          need &= ~(1u << r);
      }
      const LaneMask ready = Ballot(mine && need == 0);
      if (ready == 0) {
        Backoff(sleep_ns);
        sleep_ns = sleep_ns == 0 ? 64 : (sleep_ns >= 1024 ? 1024 : sleep_ns * 2);
        if (OpFailed(a)) return false;
        if (GlobalTimerNs() - since > g.timeout_ns) {
          const int who = LowestLane(Ballot(need != 0));
          const int tw = ShflIdx(t, who), rr = ShflIdx(__ffs(need) - 1, who);
          if (lane == 0)
            ReportError(a, kErrTimeout, kPhaseCombine, rr, round,
                        *reinterpret_cast<const volatile uint32_t*>(a.buf.push_rows +
                                                                    static_cast<size_t>(rr) * g.max_tok + tw));
          return false;
        }
        continue;
      }
      // The lanes that acquired the flags, then the whole warp reads the rows they guard.
      SyncWarp();
      pending &= ~ready;
      for (LaneMask m = ready; m != 0; m &= m - 1)
        ReduceItem<Tag, kWorld, true, kQuant>(a, p, w0 + LowestLane(m) * RW, 0, vecs, vecs, staged, false, use_w, lane);
      since = GlobalTimerNs();
      sleep_ns = 0;
    }
  }
  return true;
}

// The push combine. Pushers (blocks [0, P)) push their run of received rows chunk by chunk
// (one chunk unless staged, see the file comment) and, per chunk, every pusher block adds its
// share of the chunk's arrival to every rank (SignalPushed). Every block then reduces this rank's tokens chunk by chunk, each
// chunk as soon as every rank has signalled it; with stages > 1 the last R blocks only reduce
// (from the start, while the pushers push), the pushers join them when they are done, and a
// chunk's tokens come from a work queue shared by all blocks.
// Overlapped rounds (`overlap`, one chunk; decided alike on every rank): every pushed row is
// flagged to its source right after its stores (whole rows per warp, so one flag per row). The
// overlap kernel (kOverlap) then has its last R blocks (all blocks once they have pushed, when
// R = 0) reduce each token as soon as its rows are flagged; the chunk signal remains, waited for
// by every block before it exits: a rank may start its next dispatch (which writes into the
// peers' dispatch outputs, possibly their combine `input`) only when every peer has read all the
// rows it pushes. The plain kernel flags the rows too but reduces after the chunk signal, so
// ranks may run either kernel in the same round (the host picks per call). Two kernels, not one:
// a second inlined reduce costs the plain kernel registers (spills).
template <typename Tag, int kWorld, int kQuant, bool kStd, bool kOverlap>
__device__ __forceinline__ void PushCombine(const EpKernelArgs& a, const CombineParams& p, uint32_t round, int stages,
                                            bool overlap, const int32_t* ntok, int total, bool rows_ok, bool staged,
                                            bool use_w) {
  const EpGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  const int lane = LaneId(), nwarps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize;
  const int G = gridDim.x, vecs = p.row_bytes / 16;
  const bool overlap_reduce = kOverlap && overlap;
  const int R = stages > 1 ? min(max(p.reduce_blocks, 0), G - 1)
                           : (overlap_reduce ? min(max(p.overlap_reduce_blocks, 0), G - 1) : 0);
  const int P = G - R;
  constexpr int kAlign = kQuant == kQuantFp8Block ? kFp8BlockVecs : 1;
  if (static_cast<int>(blockIdx.x) < P) {
    MORI_PROF_BEGIN(a, kProfCombineStage, round);
    const bool weighted = kStd && st->dispatch_weighted != 0;
    // Overlapped: whole rows per warp, so that a row is complete when its warp flags it.
    const RowSplit sp = overlap ? RowSplit(total, 1, vecs, kAlign) : RowSplit(total, P * nwarps, vecs, kAlign);
    const WarpRun run(sp.items, blockIdx.x * nwarps + warp, P * nwarps);
    for (int k = 0; k < stages; ++k) {
      for (int item = run.begin; item < run.end; ++item) {
        const int i = item / sp.parts, part = item % sp.parts;
        const int pos = a.buf.src_pos[i];
        const int s = pos / g.max_send, t = pos - s * g.max_send;
        if (!staged && s == g.rank) continue;  // own rows are read in place by the reduce
        if (stages > 1) {
          const int ks = PushStages(ntok[s], p.stage_tokens);
          if (min(ks - 1, t / PushStageTokens(ntok[s], ks)) != k) continue;
        }
        PushItem<Tag, kQuant, kStd>(a, p, i, part, sp.vpp, vecs, s, t, weighted, use_w, lane);
        if (overlap) {
          // Release by one lane after the warp's stores (the warp barrier orders them before it).
          SyncWarp();
          if (lane == 0)
            StoreReleaseSys(Peer(a, a.buf.push_rows + static_cast<size_t>(g.rank) * g.max_tok + t, s), round);
        }
      }
      SignalPushed(a, k, P);
    }
    MORI_PROF_END(a, kProfCombineStage, round);
  }
  const bool wait_peer = static_cast<int>(threadIdx.x) < g.world && (staged || static_cast<int>(threadIdx.x) != g.rank);
  if (overlap_reduce) {
    bool ok = true;
    if (rows_ok && (R == 0 || static_cast<int>(blockIdx.x) >= P)) {
      MORI_PROF_BEGIN(a, kProfCombineReduce, round);
      const int first = R == 0 ? 0 : P;
      ok = ReduceWhenPushed<Tag, kWorld, kQuant>(a, p, round, (blockIdx.x - first) * nwarps + warp,
                                                 (G - first) * nwarps, staged, use_w, lane);
      MORI_PROF_END(a, kProfCombineReduce, round);
    }
    MORI_PROF_BEGIN(a, kProfCombineBarrier, round);
    if (ok && wait_peer)
      ok = WaitRound(a, a.buf.push_flags + threadIdx.x, round, kPhaseCombine, threadIdx.x, kArriveShift);
    MORI_PROF_END(a, kProfCombineBarrier, round);
    if (!__syncthreads_and(ok)) return;
  } else {
    // Reduce, chunk by chunk. This rank's own rows need no wait unless they were staged (its own
    // pushers wrote them into local staging).
    const int n = p.num_tokens;
    const int kr = PushStages(n, p.stage_tokens), per = PushStageTokens(n, kr);
    const int total_warps = G * nwarps, gwarp = blockIdx.x * nwarps + warp;
    for (int k = 0; k < kr; ++k) {
      const int lo = k * per, cnt = min(n, lo + per) - lo;
      MORI_PROF_BEGIN(a, kProfCombineBarrier, round);
      bool ok = true;
      if (wait_peer)
        ok = WaitRound(a, a.buf.push_flags + k * kMaxWorld + threadIdx.x, round, kPhaseCombine, threadIdx.x,
                       kArriveShift);
      MORI_PROF_END(a, kProfCombineBarrier, round);
      if (!__syncthreads_and(ok) || !rows_ok) return;
      if (cnt <= 0) continue;
      MORI_PROF_BEGIN(a, kProfCombineReduce, round);
      const RowSplit sp(cnt, total_warps, vecs);
      // One chunk and every block here at once: each warp starts with its own item and only the
      // items beyond one per warp come from the queue (no atomics at small batches). Otherwise
      // blocks arrive at different times: everything from the queue.
      int32_t* queue = &st->stage_items[round & 1][k];
      const bool static_first = kr == 1 && R == 0;
      const int base = static_first ? total_warps : 0;
      int item = 0;
      if (static_first) {
        item = gwarp;
      } else {
        if (lane == 0) item = atomicAdd(queue, 1);
        item = ShflIdx(item, 0);
      }
      const bool use_queue = !static_first || sp.items > total_warps;
      while (item < sp.items) {
        int next = sp.items;
        if (use_queue && lane == 0) next = base + atomicAdd(queue, 1);
        ReduceItem<Tag, kWorld, true, kQuant>(a, p, lo + item % cnt, item / cnt, sp.vpp, vecs, staged, false, use_w,
                                              lane);
        item = use_queue ? ShflIdx(next, 0) : sp.items;
      }
      MORI_PROF_END(a, kProfCombineReduce, round);
    }
  }
  // Every block has read the round; the last one to finish advances it (for the next launch: no
  // fence, the kernel boundary orders it), and block 0, past its waits, pads the unused counters.
  if (blockIdx.x == 0) PadUnusedCombineCounters(a, false, p.stage_tokens);
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&st->combine_arrive, 1u) == gridDim.x - 1) {
    st->combine_arrive = 0;
    st->combine_epoch = round;
  }
}

// The pull combine (and copy-pull): phase 0 stages this rank's weights (and copies or quantises
// its rows) for the peers, one barrier, then each token's rows are read from its destinations.
template <typename Tag, int kWorld, int kQuant>
__device__ __forceinline__ void PullCombine(const EpKernelArgs& a, const CombineParams& p, uint32_t round, int total,
                                            bool rows_ok, bool use_w) {
  constexpr int kAlign = kQuant == kQuantFp8Block ? kFp8BlockVecs : 1;
  const EpGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  const int world = g.world, vecs = p.row_bytes / 16, lane = LaneId();
  const int nwarps = blockDim.x / kWarpSize;
  const int gwarp = blockIdx.x * nwarps + threadIdx.x / kWarpSize, total_warps = gridDim.x * nwarps;
  MORI_PROF_BEGIN(a, kProfCombineStage, round);
  {
    // Peers read these in phase 1. Not the dispatch's own weights in place: a third rank's next
    // dispatch may overwrite those while this combine's readers are still reducing.
    if (use_w) {
      const int n = total * g.topk;
      for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        a.buf.combine_inp_weights[i] = p.weights[i];
    }
    const uint8_t* rows_in = p.copy_input ? p.input : a.buf.combine_inp;
    if constexpr (kQuant != kQuantNone) {
      // Quantise this rank's rows (every rank, this one included, reads them).
      const RowSplit sp(total, total_warps, vecs, kAlign);
      for (int item = gwarp; item < sp.items; item += total_warps) {
        const int i = item % total, part = item / total;
        const int v0b = part * sp.vpp, v1 = min(vecs, v0b + sp.vpp);
        QuantizeRow<kQuant>(reinterpret_cast<const int4*>(rows_in + static_cast<size_t>(i) * p.row_bytes),
                            a.buf.stage + static_cast<size_t>(i) * p.row_bytes, p.row_bytes, v0b, v1, lane);
      }
    } else if (p.copy_input) {
      // Copy-pull: the caller's rows into the registered buffer the peers read (a local copy);
      // this rank's own rows stay where they are unless they must be staged (p.stage_own).
      const RowSplit sp(total, total_warps, vecs);
      for (int item = gwarp; item < sp.items; item += total_warps) {
        const int i = item % total, part = item / total;
        if (!p.stage_own && a.buf.src_pos[i] / g.max_send == g.rank) continue;
        const int4* src = reinterpret_cast<const int4*>(p.input + static_cast<size_t>(i) * p.row_bytes);
        int4* dst = reinterpret_cast<int4*>(a.buf.combine_inp + static_cast<size_t>(i) * p.row_bytes);
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
      }
    }
  }
  MORI_PROF_END(a, kProfCombineStage, round);
  MORI_PROF_BEGIN(a, kProfCombineBarrier, round);

  // Barrier with every peer. The own counter also orders this rank's phase 0 before its phase 1
  // in every block.
  ArriveAtPeers(a, a.buf.combine_flags + g.rank, world, gridDim.x);
  const bool flag_peer = static_cast<int>(threadIdx.x) < world;
  bool ok = true;
  if (flag_peer) ok = WaitRound(a, a.buf.combine_flags + threadIdx.x, round, kPhaseCombine, threadIdx.x, kArriveShift);
  MORI_PROF_END(a, kProfCombineBarrier, round);
  ok = __syncthreads_and(ok);
  if (ok && blockIdx.x == 0) {
    // Every block of this rank has arrived, so each has read the round: the next launch's.
    if (threadIdx.x == 0) st->combine_epoch = round;
    PadUnusedCombineCounters(a, true, 0);
  }
  if (!ok || !rows_ok) return;
  MORI_PROF_BEGIN(a, kProfCombineReduce, round);

  // Phase 1: out[t] = sum over t's destination ranks of their row for t (fp32).
  const int n = p.num_tokens;
  const RowSplit sp(n, total_warps, vecs);
  const bool own_in_input = p.copy_input && !p.stage_own && kQuant == kQuantNone;
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
    ReduceItem<Tag, kWorld, false, kQuant>(a, p, item % n, item / n, sp.vpp, vecs, false, own_in_input, use_w, lane);
    item = use_queue ? ShflIdx(next, 0) : sp.items;
  }
  MORI_PROF_END(a, kProfCombineReduce, round);
}

// kSmallPush (pull kernel, BF16/fp32 rows): a small round pushes instead (CombineParams::
// pull_push_tokens). A kernel of its own, so that the pure pull kernel's registers stay as they were.
template <typename Tag, int kWorld, bool kPush, int kQuant, bool kStd, bool kOverlap, bool kSmallPush = false>
__global__ void __launch_bounds__(kCombineMaxThreads) CombineKernel(EpKernelArgs a, CombineParams p) {
  static_assert(!kStd || kPush, "the standard-MoE combine pushes");
  static_assert(!kOverlap || kPush, "only the push combine overlaps");
  static_assert(!kSmallPush || (!kPush && kQuant == kQuantNone), "only the plain pull kernel pushes small rounds");
  static_assert(kQuant == kQuantNone || std::is_same<Tag, Bf16Tag>::value, "FP8 combine carries bf16 rows");
  // Own rows go through local staging too (push): summed from 3-D rows (standard MoE) or quantised,
  // or copied when they (or their weights) lie in this rank's dispatch outputs (p.stage_own).
  constexpr bool kStaged = kStd || kQuant != kQuantNone;
  const EpGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const bool staged = kStaged || p.stage_own;
  const uint32_t round = st->combine_epoch + 1;
  // The previous launch used the other queues and has completed: clear them for the next one.
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) st->combine_items[(round + 1) & 1] = 0;
    if (threadIdx.x < kMaxPushStages) st->stage_items[(round + 1) & 1][threadIdx.x] = 0;
  }
  int total = st->total_recv;
  bool use_w = !kStd && p.weights != nullptr;
  bool rows_ok = !p.check_input_rows || total <= p.input_rows;
  if (!rows_ok) {
    if (blockIdx.x == 0 && threadIdx.x == 0) ReportError(a, kErrCombineRows, kPhaseCombine, -1, total, p.input_rows);
    total = 0;
  }
  if (kStd && st->std_round != st->dispatch_epoch) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      ReportError(a, kErrStdStale, kPhaseCombine, -1, st->std_round, st->dispatch_epoch);
    rows_ok = false;
    total = 0;
  }
  if (use_w && total > p.weight_rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0) ReportError(a, kErrCombineWeightRows, kPhaseCombine, -1, total, p.weight_rows);
    use_w = false;
  }
  // Staged when some source has more tokens than one chunk; every rank decides alike (each has
  // every source's token count from the dispatch). So does a pull call on a small round.
  const int32_t* ntok = a.buf.peer_tokens + (st->dispatch_epoch & 1) * kMaxWorld;
  int stages = 1, tokens = 0, most = 0;
  for (int s = 0; s < g.world; ++s) {
    stages = max(stages, PushStages(ntok[s], p.stage_tokens));
    tokens += ntok[s];
    most = max(most, ntok[s]);
  }
  if constexpr (kPush) {
    const bool overlap = stages == 1 && p.overlap_tokens >= 0 && tokens >= p.overlap_tokens;
    PushCombine<Tag, kWorld, kQuant, kStd, kOverlap>(a, p, round, stages, overlap, ntok, total, rows_ok, staged,
                                                     use_w);
  } else {
    if constexpr (kSmallPush) {
      // A small round of a pull call pushes the registered rows instead: the pull's barrier and
      // remote reads are two NVLink round trips where pushed stores need one, which is most of a
      // small round's time (EP4 x 128 tokens: 32 us pushed, 37-38 pulled; the pull kernel leads
      // from 512 tokens). Unstaged rounds only.
      // (The host points p.input at the registered rows for these calls.)
      if (stages == 1 && most <= p.pull_push_tokens) {
        PushCombine<Tag, kWorld, kQuant, kStd, false>(a, p, round, 1, false, ntok, total, rows_ok, staged, use_w);
        return;
      }
    }
    PullCombine<Tag, kWorld, kQuant>(a, p, round, total, rows_ok, use_w);
  }
}

// One kernel variant: element tag, FP8 transport, standard-MoE input. Push calls run the overlap
// kernel when CombineParams::overlap_kernel says so.
template <typename Tag, int kQuant, bool kStd>
struct CombineVariant {
  template <int kWorld, bool kPush, bool kOverlap, bool kSmallPush = false>
  static void Launch(const EpKernelArgs& args, const CombineParams& params, int blocks, int threads,
                     gpuStream_t stream) {
    CombineKernel<Tag, kWorld, kPush, kQuant, kStd, kOverlap, kSmallPush><<<blocks, threads, 0, stream>>>(args, params);
  }
  template <int kWorld, bool kPush, bool kOverlap, bool kSmallPush = false>
  static int BlocksPerSm(int threads) {
    int n = 0;
    MORI_GPU_CHECK(gpuOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, CombineKernel<Tag, kWorld, kPush, kQuant, kStd, kOverlap, kSmallPush>, threads, 0));
    return n;
  }
  // The pull kernels: plain, or pushing small rounds (pull_push_tokens > 0; BF16/fp32 rows only).
  // A rank with more tokens than pull_push_tokens knows that its round is not small, so it runs the
  // plain kernel: the same algorithm as its peers' (they decide from every source's count), and
  // the plain kernel's registers (the other spills more: EP4 76 bytes against 32).
  static constexpr bool kHasSmallPush = kQuant == kQuantNone && !kStd;
  template <int kWorld>
  static void LaunchPull(const EpKernelArgs& args, const CombineParams& params, int blocks, int threads,
                         gpuStream_t stream) {
    if constexpr (kHasSmallPush) {
      if (params.pull_push_tokens > 0 && params.num_tokens <= params.pull_push_tokens && !params.copy_input)
        return Launch<kWorld, false, false, true>(args, params, blocks, threads, stream);
    }
    Launch<kWorld, false, false>(args, params, blocks, threads, stream);
  }
  template <int kWorld>
  static int BlocksPerSmPull(int threads) {
    if constexpr (kHasSmallPush)
      return std::min(BlocksPerSm<kWorld, false, false>(threads), BlocksPerSm<kWorld, false, false, true>(threads));
    return BlocksPerSm<kWorld, false, false>(threads);
  }
  template <int kWorld>
  static void LaunchPush(const EpKernelArgs& args, const CombineParams& params, int blocks, int threads,
                         gpuStream_t stream) {
    params.overlap_kernel ? Launch<kWorld, true, true>(args, params, blocks, threads, stream)
                          : Launch<kWorld, true, false>(args, params, blocks, threads, stream);
  }
  // Either push kernel may run on the grid the launcher clamps: the fewer blocks of the two.
  template <int kWorld>
  static int BlocksPerSmPush(int threads) {
    return std::min(BlocksPerSm<kWorld, true, false>(threads), BlocksPerSm<kWorld, true, true>(threads));
  }
  // The standard-MoE variant only pushes: its pull instantiation never exists.
  template <int kWorld>
  static void LaunchMode(bool push, const EpKernelArgs& args, const CombineParams& params, int blocks, int threads,
                         gpuStream_t stream) {
    if constexpr (kStd) {
      LaunchPush<kWorld>(args, params, blocks, threads, stream);
    } else {
      push ? LaunchPush<kWorld>(args, params, blocks, threads, stream)
           : LaunchPull<kWorld>(args, params, blocks, threads, stream);
    }
  }
  template <int kWorld>
  static int BlocksPerSmMode(bool push, int threads) {
    if constexpr (kStd) {
      return BlocksPerSmPush<kWorld>(threads);
    } else {
      return push ? BlocksPerSmPush<kWorld>(threads) : BlocksPerSmPull<kWorld>(threads);
    }
  }
  static void LaunchFor(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                        gpuStream_t stream) {
    const int w = args.geo.world <= 2 ? 2 : (args.geo.world <= 4 ? 4 : 8);
    if (w == 2)
      LaunchMode<2>(push, args, params, blocks, threads, stream);
    else if (w == 4)
      LaunchMode<4>(push, args, params, blocks, threads, stream);
    else
      LaunchMode<8>(push, args, params, blocks, threads, stream);
  }
  static int BlocksPerSmForWorld(int world, bool push, int threads) {
    const int w = world <= 2 ? 2 : (world <= 4 ? 4 : 8);
    return w == 2 ? BlocksPerSmMode<2>(push, threads)
                  : (w == 4 ? BlocksPerSmMode<4>(push, threads) : BlocksPerSmMode<8>(push, threads));
  }
};

// Instantiated in separate translation units so they compile in parallel:
// ep_combine_{bf16,fp32}.cu (plain), ep_combine_fp8.cu (FP8 transport),
// ep_combine_std.cu (standard-MoE input).
void LaunchCombineBf16(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                       gpuStream_t stream);
void LaunchCombineFp32(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                       gpuStream_t stream);
void LaunchCombineFp8(const EpKernelArgs& args, const CombineParams& params, bool push, int blocks, int threads,
                      gpuStream_t stream);
void LaunchCombineStd(const EpKernelArgs& args, const CombineParams& params, CombineDtype dtype, int blocks,
                      int threads, gpuStream_t stream);
int CombineBlocksPerSmBf16(int world, bool push, int threads);
int CombineBlocksPerSmFp32(int world, bool push, int threads);
int CombineBlocksPerSmFp8(int world, int quant, bool push, int threads);
int CombineBlocksPerSmStd(int world, CombineDtype dtype, int quant, int threads);

}  // namespace dev
}  // namespace mori::ep
