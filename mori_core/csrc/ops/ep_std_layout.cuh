// Device side of the standard-MoE (DeepEP 3-D) layout shared by the dispatch
// kernel, the plan / converter kernels (ep_standard_moe.cu) and the combine.
//
// Layout on each rank: packed row (local expert el, position j) = el * tpe + j,
// tpe = world * max_num_inp_token_per_rank. Within a local expert rows are
// ordered by source rank, then source token (stable): position of token t of
// source s = (rows that sources < s send to the expert) + (tokens of s before t
// routed to it). Tokens rank themselves with one bitmap per expert over their
// token index (set bits, then an exclusive prefix popcount per 32-bit word), so a
// row's position is prefix[w] + popc(bits[w] & lanes below). A token listing the
// same expert twice gets one row; both of its k entries point at it.
#pragma once

#include "ops/device_primitives.hpp"
#include "ops/ep_device_common.hpp"
#include "ops/ep_profiler.cuh"
#include "ops/ep_quant.cuh"

namespace mori::ep::dev {

constexpr int kQuantUnroll = 4;  // summed rows: vectors per lane (their fp32 sums stay in registers)

// Position of bit `idx` among the set bits of a bitmap with per-word exclusive prefix counts.
__device__ __forceinline__ int BitRank(const uint32_t* bits, const int32_t* prefix, int idx) {
  const int w = idx >> 5;
  return prefix[w] + __popc(bits[w] & ((1u << (idx & 31)) - 1u));
}

// Exclusive prefix popcount of words [0, nw) of `bits` into `prefix`; returns the
// number of set bits. Called by every lane of one warp.
__device__ __forceinline__ int WarpScanBits(const uint32_t* bits, int32_t* prefix, int nw, int lane) {
  int run = 0;
  for (int w0 = 0; w0 < nw; w0 += kWarpSize) {
    const int w = w0 + lane;
    const int c = w < nw ? __popc(*reinterpret_cast<const volatile uint32_t*>(bits + w)) : 0;
    int x = c;
#pragma unroll
    for (int d = 1; d < kWarpSize; d <<= 1) {
      const int y = ShflUp(x, d);
      if (lane >= d) x += y;
    }
    if (w < nw) prefix[w] = run + x - c;
    run += ShflIdx(x, kWarpSize - 1);
  }
  return run;
}

// The first of a token's top-k entries (before `k`) that names expert `e`, or `k`: a token sent
// to one expert twice is one row there.
__device__ __forceinline__ int FirstEntryOf(const int32_t* ids, int k, int e) {
  for (int j = 0; j < k; ++j)
    if (ids[j] == e) return j;
  return k;
}

// Position of every k entry of this rank's token t among this rank's rows of expert
// ids[k] (a bitmap rank: tokens before t routed to the same expert); -1 for dropped
// ids. An entry repeating an earlier expert of the token gets that entry's position
// (one row per distinct expert). `plan_parity`: the bitmap the plan kernel just
// before this dispatch set ((std_plans - 1) & 1). The receiver adds the rows of
// earlier sources (StdExpandKernel).
__device__ __forceinline__ void StdTokenRel(const EpKernelArgs& a, uint32_t plan_parity, int t, const int32_t* ids,
                                            int32_t* rel) {
  const EpGeometry& g = a.geo;
  const uint32_t* bits = a.std.plan_bits + static_cast<size_t>(plan_parity) * g.num_experts * g.tok_words;
  for (int k = 0; k < g.topk; ++k) {
    const int e = ids[k];
    int r = -1;
    if (e >= 0 && e < g.num_experts) {
      const int first = FirstEntryOf(ids, k, e);
      if (first < k) {
        r = rel[first];
      } else {
        const size_t off = static_cast<size_t>(e) * g.tok_words;
        r = BitRank(bits + off, a.std.plan_prefix + off, t);
      }
    }
    rel[k] = r;
  }
}

// Fused ranking (kStdFused): no kernel before the dispatch and no wait between its blocks. A
// block of tokens [begin, end) counts per expert the tokens before `begin` routed to it from the
// top-k ids (every block for itself, in shared memory), then per round of tokens [r0, r0 + cnt)
// ranks each (token, expert) among the round's tokens: a round of up to kDirectRankTokens tokens
// from its ids in shared memory (StdRankSmallRound), a larger one by the expert's token bitmap (the
// block set those bits itself; words shared with a neighbour's tokens are masked), and adds the
// round's counts. The block of the last token then holds the rank's per-expert totals and sends them
// with the dispatch's signal (receivers need them only after waiting for that signal).
//
// Every step runs one thread per top-k entry, not per token: a token's entries are ranked by
// eight threads at once, and the loads of a token's ids are coalesced (#31 round 10: one thread
// per token spent ~3 us on its entries' dependent loads, and the count update after the ranking,
// issued while the block's other warps were already storing rows over NVLink, waited 1-16 us
// behind their stores, delaying that warp's own rows). The count of the tokens before the block
// runs in its first round between issuing the slot reservations and reading them. Counted before
// the route (round 10), it took up to 5 us in the blocks of the last tokens, so those blocks
// reserved and started their rows late (copies began at 6-14 us, against 3-4 us in the 2-D
// dispatch). It still takes up to ~4 us there (profiler, EP4 x 128, #31 round 11), now beside the
// reservation's round trip: the copies begin at 5-8 us.

// Whether entry k of a token (its lanes consecutive in one warp, lane of entry 0 = lane - k)
// names the same expert e as an earlier entry of that token: one row per distinct expert. Every
// lane of the warp must call it (the shuffles take no short-circuit). kTopk > 0: top-k known at
// compile time, the shuffles unrolled so that they issue back to back; 0: bounded by `topk`.
template <int kTopk>
__device__ __forceinline__ bool RepeatsEarlierEntry(int e, int k, int topk) {
  bool dup = false;
  if constexpr (kTopk > 0) {
#pragma unroll
    for (int d = 1; d < kTopk; ++d) {
      const int ed = ShflUp(e, d);
      dup |= k >= d && ed == e;
    }
  } else {
    for (int d = 1; d < topk; ++d) {
      const int ed = ShflUp(e, d);
      dup |= k >= d && ed == e;
    }
  }
  return dup;
}

// s_cnt[e] += tokens [0, n) of `ids` (their top-k ids) routed to expert e, a token listing e twice
// counted once; one lane per top-k entry, kCountUnroll entries per lane in flight (one memory round
// trip for up to blockDim * kCountUnroll entries: the block of the last of 128 tokens counts 127 x 8
// with 128 threads), each warp's loads one coalesced run of entries. When topk divides the warp
// size (kTopk > 0) a token's entries sit in consecutive lanes of one warp (every warp starts on a
// token), so repeats are found by shuffles instead of reloading the token's earlier ids; otherwise
// (kTopk == 0) each entry rereads them. With top-k known at compile time the shuffles are unrolled
// and issue back to back: with a runtime bound each waited for the one before, ~1.7 us of the
// count of a block's 66 tokens before it (std_count_probe, #31 round 14). Threads below
// `first_thread` (a multiple of the warp size, below blockDim) return at once.
template <int kTopk>
__device__ __forceinline__ void CountFirstEntriesOf(const EpKernelArgs& a, int32_t* s_cnt, const int32_t* ids, int n,
                                                    int first_thread) {
  constexpr int kCountUnroll = 8;
  const int tid = static_cast<int>(threadIdx.x) - first_thread;
  if (tid < 0) return;  // uniform per warp
  const int topk = kTopk > 0 ? kTopk : a.geo.topk, ne = a.geo.num_experts, entries = n * topk;
  const int T = blockDim.x - first_thread, lane = LaneId();
  for (int w0 = tid - lane; w0 < entries; w0 += T * kCountUnroll) {  // uniform per warp
    int ev[kCountUnroll];
#pragma unroll
    for (int u = 0; u < kCountUnroll; ++u) {
      const int i = w0 + u * T + lane;
      ev[u] = i < entries ? ids[i] : -1;
    }
#pragma unroll
    for (int u = 0; u < kCountUnroll; ++u) {
      if (w0 + u * T >= entries) break;  // uniform per warp: the shuffles below see every lane
      const int i = w0 + u * T + lane, e = ev[u];
      bool first;
      if constexpr (kTopk > 0) {
        // w0 and T are multiples of the warp size, kTopk divides it
        first = !RepeatsEarlierEntry<kTopk>(e, lane % kTopk, kTopk);
      } else {
        const int k = i % topk;
        first = e >= 0 && FirstEntryOf(ids + (i - k), k, e) == k;
      }
      if (e >= 0 && e < ne && first) atomicAdd(s_cnt + e, 1);
    }
  }
}

// CountFirstEntriesOf with top-k as a compile-time constant where it divides the warp size.
// Called by every thread; the caller's barrier orders the counts.
__device__ __forceinline__ void CountFirstEntries(const EpKernelArgs& a, int32_t* s_cnt, const int32_t* ids, int n,
                                                  int first_thread = 0) {
  switch (a.geo.topk) {
    case 8: return CountFirstEntriesOf<8>(a, s_cnt, ids, n, first_thread);
    case 4: return CountFirstEntriesOf<4>(a, s_cnt, ids, n, first_thread);
    case 2: return CountFirstEntriesOf<2>(a, s_cnt, ids, n, first_thread);
    case 1: return CountFirstEntriesOf<1>(a, s_cnt, ids, n, first_thread);
    case 16: return CountFirstEntriesOf<16>(a, s_cnt, ids, n, first_thread);
    case 32: return CountFirstEntriesOf<32>(a, s_cnt, ids, n, first_thread);
    default: return CountFirstEntriesOf<0>(a, s_cnt, ids, n, first_thread);
  }
}

// Before the block's first round: s_cnt zeroed (the first round adds the tokens before the block
// while its slot reservations are in flight, DispatchKernel), and the other parity's bitmap words
// that its last use set are cleared (the next dispatch_standard_moe sets bits there).
__device__ __forceinline__ void StdFusedStart(const EpKernelArgs& a, uint32_t parity, int32_t* s_cnt) {
  const EpGeometry& g = a.geo;
  const int ne = g.num_experts, words = g.tok_words, tid = threadIdx.x, T = blockDim.x;
  for (int e = tid; e < ne; e += T) s_cnt[e] = 0;
  __syncthreads();
  uint32_t* other = a.std.plan_bits + static_cast<size_t>(parity ^ 1) * ne * words;
  const int stale = a.buf.sync->plan_words[parity ^ 1];
  const int gtid = blockIdx.x * T + tid, gthreads = gridDim.x * T;
  for (int i = gtid; i < ne * stale; i += gthreads) other[static_cast<size_t>(i / stale) * words + i % stale] = 0;
}

// The round's tokens [r0, r0 + cnt) into the per-expert token bitmaps `bits` (bit t of expert e's
// words: token t lists e), one thread per top-k entry: every entry's id is requested before any
// bit is set, and the bits are set without a reply. Before, the thread of a token loaded an id and
// set its bit by a returning atomic eight times in a row: up to 3.0 us in the EP4 x 128 profile,
// 2.4 us this way (#31 round 11).
__device__ __forceinline__ void StdSetRoundBits(const EpKernelArgs& a, uint32_t* bits, const int32_t* ids, int r0,
                                                int cnt) {
  constexpr int kBitsUnroll = 8;
  const int topk = a.geo.topk, ne = a.geo.num_experts, words = a.geo.tok_words, T = blockDim.x;
  const int entries = cnt * topk;
  const int32_t* round_ids = ids + static_cast<size_t>(r0) * topk;
  for (int i0 = threadIdx.x; i0 < entries; i0 += T * kBitsUnroll) {
    int ev[kBitsUnroll];
#pragma unroll
    for (int u = 0; u < kBitsUnroll; ++u) ev[u] = i0 + u * T < entries ? round_ids[i0 + u * T] : -1;
#pragma unroll
    for (int u = 0; u < kBitsUnroll; ++u) {
      const int e = ev[u], t = r0 + (i0 + u * T) / topk;
      if (e >= 0 && e < ne) RedOrGpu(bits + static_cast<size_t>(e) * words + (t >> 5), 1u << (t & 31));
    }
  }
}

// The ranking of a small round (kDirectRankTokens tokens at most, one top-k entry per thread)
// without the bitmaps: on entry s_rel holds the round's ids (s_rel[li * topk + k], set by the
// mask step), on return the positions as StdRankRound gives them. An entry's position is s_cnt[e]
// plus the round's earlier tokens listing e, counted from those ids in shared memory. At 128 and
// 512 tokens a block's round is 1 to 8 tokens, and the bitmap path spent a global-memory round
// trip on bits set by red.or and read back behind a barrier (#31 round 14). Called by every thread.
constexpr int kDirectRankTokens = 8;
__device__ __forceinline__ void StdRankSmallRound(const EpKernelArgs& a, const int32_t* s_cnt, int cnt, int32_t* s_rel) {
  const int topk = a.geo.topk, ne = a.geo.num_experts, i = threadIdx.x;
  int rel = -1;
  if (i < cnt * topk) {
    const int e = s_rel[i], li = i / topk;
    if (e >= 0 && e < ne) {
      rel = s_cnt[e];
      for (int lj = 0; lj < li; ++lj) {
        bool lists = false;  // a token naming e twice is one row of e
        for (int k = 0; k < topk; ++k) lists |= s_rel[lj * topk + k] == e;
        rel += lists ? 1 : 0;
      }
    }
  }
  __syncthreads();  // every entry has read the ids before any is overwritten
  if (i < cnt * topk) s_rel[i] = rel;
}

// Set bits [lo, hi) of a bitmap that other blocks may still be setting outside that range.
__device__ __forceinline__ int CountBitsIn(const uint32_t* bits, int lo, int hi) {
  int c = 0;
  if (lo >= hi) return 0;
  for (int w = lo >> 5; w <= (hi - 1) >> 5; ++w) {
    uint32_t x = *reinterpret_cast<const volatile uint32_t*>(bits + w);  // set by atomics of this block
    if (w == lo >> 5) x &= ~0u << (lo & 31);
    if (w == hi >> 5) x &= (1u << (hi & 31)) - 1u;
    c += __popc(x);
  }
  return c;
}

// The ranking of one round, tokens [r0, r0 + cnt), after the barrier that follows the round's
// bits (this dispatch's parity, `bits`) and s_cnt (the tokens before r0): s_rel[li * topk + k] =
// position of token r0 + li's entry k among this rank's rows of its expert, -1 for dropped ids.
// Entries naming one expert twice get the same position (the same count). Called by every thread.
__device__ __forceinline__ void StdRankRound(const EpKernelArgs& a, const uint32_t* bits, const int32_t* s_cnt,
                                             const int32_t* ids, int r0, int cnt, int32_t* s_rel) {
  const EpGeometry& g = a.geo;
  const int topk = g.topk;
  const int32_t* round_ids = ids + static_cast<size_t>(r0) * topk;
  for (int i = threadIdx.x; i < cnt * topk; i += blockDim.x) {
    const int e = round_ids[i];
    s_rel[i] = e >= 0 && e < g.num_experts
                   ? s_cnt[e] + CountBitsIn(bits + static_cast<size_t>(e) * g.tok_words, r0, r0 + i / topk)
                   : -1;
  }
}

// The expand of dispatch_standard_moe (StdExpandKernel, or the tail of the one-launch dispatch),
// once this rank's dispatch of `round` has waited for every source: every received row to each of
// its distinct local experts' [expert][position] slots. position = rows that earlier sources send
// to the expert (their counts, std_counts) + the row's position among its own source's rows of
// the expert (std_rel, written by the source's dispatch). Block 0 writes packed_count and the
// layout ranges. s_base: [world][experts_per_rank] shared ints.
//
// Work item = (group of R = warp size / topk consecutive received rows, slice of the row): lane
// (r, k) holds row r's entry k, so one coalesced load gives the warp the R rows' ids and
// positions; the warp then loads the slice of up to kExpandBatch rows at once and stores each to
// that row's local experts. A row has 1 to topk local experts (2.2 on average at EP4, top-8 of
// 256), so items of one row each were as uneven as that; a group of rows evens the stores out,
// and the batched loads wait for memory once per batch instead of once per row (#31 round 10).
constexpr int kExpandBatch = 4;   // rows whose slices a lane holds at once
constexpr int kExpandUnroll = 4;  // 16-byte vectors of each row a lane holds per pass
constexpr int kExpandMinSliceVecs = 2 * kWarpSize;  // the shortest slice of a row an item copies

// Vectors [v0 + lane + u * warp size] (u < kExpandUnroll, below v1) of received rows [first, first + nb) into
// xv[b][u]: one pass of the expand over a batch of rows.
__device__ __forceinline__ void LoadExpandBatch(const EpKernelArgs& a, int row_bytes, int first, int nb, int v0, int v1,
                                                int lane, int4 (&xv)[kExpandBatch][kExpandUnroll]) {
#pragma unroll
  for (int b = 0; b < kExpandBatch; ++b) {
    if (b >= nb) break;
    const int4* src = reinterpret_cast<const int4*>(a.buf.dispatch_out + static_cast<size_t>(first + b) * row_bytes);
#pragma unroll
    for (int u = 0; u < kExpandUnroll; ++u) {
      const int v = v0 + lane + u * kWarpSize;
      if (v < v1) xv[b][u] = LoadPeer(src + v);
    }
  }
}

__device__ __forceinline__ void StdExpandRows(const EpKernelArgs& a, int row_bytes, uint32_t round, int32_t* s_base) {
  const EpGeometry& g = a.geo;
  const int tid = threadIdx.x, T = blockDim.x, epr = g.experts_per_rank, ne = g.num_experts;
  const int32_t* counts = a.buf.std_counts + static_cast<size_t>(round & 1) * g.world * ne;
  // volatile: the one-launch tail's blocks read the sync state (its cache line) before its last block set it
  const int total = *reinterpret_cast<volatile int32_t*>(&a.buf.sync->total_recv);
  MORI_PROF_BEGIN(a, kProfStdExpandBase, round);
  for (int el = tid; el < epr; el += T) {
    const int e = g.rank * epr + el;
    int c[kMaxWorld];  // every source's count requested before any is used: one round trip
#pragma unroll
    for (int s = 0; s < kMaxWorld; ++s) c[s] = s < g.world ? LoadRelaxedSys(counts + static_cast<size_t>(s) * ne + e) : 0;
    int run = 0;
#pragma unroll
    for (int s = 0; s < kMaxWorld; ++s) {
      if (s >= g.world) break;
      s_base[s * epr + el] = run;
      if (blockIdx.x == 0)
        a.std.layout_range[static_cast<size_t>(el) * g.world + s] =
            static_cast<int64_t>(static_cast<uint32_t>(c[s])) | (static_cast<int64_t>(run) << 32);
      run += c[s];
    }
    if (blockIdx.x == 0) a.std.packed_count[el] = run;
  }
  __syncthreads();
  MORI_PROF_END(a, kProfStdExpandBase, round);
  MORI_PROF_BEGIN(a, kProfStdExpandItems, round);
  const int vecs = row_bytes / 16, lane = LaneId(), topk = g.topk;
  const int rows_per_group = max(1, kWarpSize / topk), groups = (total + rows_per_group - 1) / rows_per_group;
  const int nwarps = T / kWarpSize;
  // consecutive items on different SMs: with fewer items than warps every SM still gets some
  const int gwarp = (tid / kWarpSize) * gridDim.x + blockIdx.x, total_warps = gridDim.x * nwarps;
  constexpr int kUnroll = kExpandUnroll;
  // slices: enough items for every warp, none shorter than two vectors per lane. That floor (half
  // a pass) beat a full pass: 7.0 against 7.3 us for the expand kernel alone at EP2 x 128 (2xH200,
  // #31 round 12); a one-vector floor was no faster, two blocks per SM or 16-warp blocks slower.
  int parts = max(1, total_warps / max(groups, 1));
  parts = min(parts, max(1, vecs / kExpandMinSliceVecs));
  const int vpp = (vecs + parts - 1) / parts;
  const int k = lane % topk, sub = lane / topk;  // this lane: entry k of the group's row `sub`
  for (int item = gwarp; item < groups * parts; item += total_warps) {
    const int grp = item % groups, part = item / groups;
    const int i = grp * rows_per_group + sub;
    const bool have = sub < rows_per_group && i < total;
    const int v1 = min(vecs, (part + 1) * vpp);
    const int group_rows = min(rows_per_group, total - grp * rows_per_group);
    // The first batch's slices are requested before the ids and positions that say where they
    // go, so the two memory round trips overlap (most items are one batch and one pass).
    int4 xv[kExpandBatch][kUnroll];
    if (item == gwarp) MORI_PROF_BEGIN(a, kProfStdExpandFirst, round);
    LoadExpandBatch(a, row_bytes, grp * rows_per_group, min(kExpandBatch, group_rows), part * vpp, v1, lane, xv);
    const int32_t flat = have ? a.buf.src_pos[i] : 0;
    const int e = have ? a.buf.dispatch_out_indices[static_cast<size_t>(i) * topk + k] : -1;
    const int rel = have ? a.std.std_rel[static_cast<size_t>(i) * topk + k] : -1;
    const bool dup = RepeatsEarlierEntry<0>(e, k, topk);
    const int el = e - g.rank * epr, s = flat / g.max_send;
    const int row = (rel >= 0 && el >= 0 && el < epr) ? el * g.tpe + s_base[s * epr + el] + rel : -1;
    const bool store = row >= 0 && !dup;
    if (part == 0) {
      if (have) a.std.std_row[static_cast<size_t>(i) * topk + k] = row;
      if (store) a.std.packed_src_info[row] = flat;
      if (g.scale_bytes > 0) {
        for (LaneMask m = Ballot(store); m != 0; m &= m - 1) {
          const int l = LowestLane(m);
          const int rk = ShflIdx(row, l), ik = grp * rows_per_group + l / topk;
          CopySmall(a.std.packed_scales + static_cast<size_t>(rk) * g.scale_bytes,
                    a.buf.dispatch_out_scales + static_cast<size_t>(ik) * g.scale_bytes, g.scale_bytes, lane);
        }
      }
    }
    const LaneMask stores = Ballot(store);
    for (int r0 = 0; r0 < group_rows; r0 += kExpandBatch) {
      const int nb = min(kExpandBatch, group_rows - r0);
      for (int v0 = part * vpp; v0 < v1; v0 += kWarpSize * kUnroll) {
        if (r0 != 0 || v0 != part * vpp)  // the first pass was loaded above
          LoadExpandBatch(a, row_bytes, grp * rows_per_group + r0, nb, v0, v1, lane, xv);
#pragma unroll
        for (int b = 0; b < kExpandBatch; ++b) {
          if (b >= nb) break;
          // the lanes of row r0 + b that store: its distinct local experts
          const int first_lane = (r0 + b) * topk;
          LaneMask m = (stores >> first_lane) & ((topk >= kWarpSize) ? ~LaneMask(0) : ((LaneMask(1) << topk) - 1));
          for (; m != 0; m &= m - 1) {
            const int rk = ShflIdx(row, first_lane + LowestLane(m));
            int4* dst = reinterpret_cast<int4*>(a.std.packed_x + static_cast<size_t>(rk) * row_bytes);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int v = v0 + lane + u * kWarpSize;
              if (v < v1) Store16(dst + v, xv[b][u]);
            }
          }
        }
        // after the first pass's stores, which needed its loads
        if (item == gwarp && r0 == 0 && v0 == part * vpp) MORI_PROF_END(a, kProfStdExpandFirst, round);
      }
    }
  }
  MORI_PROF_END(a, kProfStdExpandItems, round);
}

// Standard MoE: vectors [v0b, v1) of sum_k w_k * packed[row_k] for received token i
// (fp32, products rounded alone, k in order; rows of other ranks' experts are -1),
// rounded to the row dtype, stored to dst_row as is or FP8-quantised.
template <typename Tag, int kQuant>
__device__ __forceinline__ void StdReduceRow(const EpKernelArgs& a, const uint8_t* packed, int row_bytes, int i,
                                             bool weighted, uint8_t* dst_row, bool quantise, int v0b, int v1, int lane) {
  using VT = VecTraits<Tag>;
  constexpr int kE = VT::kElems;
  const int topk = a.geo.topk, vecs = row_bytes / 16;
  const int my_row = lane < topk ? a.std.std_row[static_cast<size_t>(i) * topk + lane] : -1;
  const float my_w = (lane < topk && weighted) ? a.buf.dispatch_out_weights[static_cast<size_t>(i) * topk + lane] : 1.f;
  for (int v0 = v0b; v0 < v1; v0 += kWarpSize * kQuantUnroll) {
    float acc[kQuantUnroll][kE];
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u)
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[u][e] = 0.f;
    for (int k = 0; k < topk; ++k) {
      const int row = ShflIdx(my_row, k);
      const float w = ShflIdxF(my_w, k);
      if (row < 0) continue;  // uniform across the warp
      const int4* src = reinterpret_cast<const int4*>(packed) + static_cast<size_t>(row) * vecs;
      int4 x[kQuantUnroll];
#pragma unroll
      for (int u = 0; u < kQuantUnroll; ++u) {
        const int v = v0 + lane + u * kWarpSize;
        if (v < v1) x[u] = LoadStream(src + v);
      }
#pragma unroll
      for (int u = 0; u < kQuantUnroll; ++u)
        if (v0 + lane + u * kWarpSize < v1) VT::AccumulateScaled(acc[u], x[u], w);
    }
    [[maybe_unused]] float sc[kQuantUnroll];
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
      const int v = v0 + lane + u * kWarpSize;
      if constexpr (kQuant != kQuantNone) {
        if (quantise) {  // uniform: one destination per row
          VT::Round(acc[u]);
          sc[u] = Fp8QuantStore<kQuant>(acc[u], v < v1, dst_row, row_bytes, v);
          continue;
        }
      }
      if (v < v1) Store16(reinterpret_cast<int4*>(dst_row) + v, VT::Pack(acc[u]));
    }
    if constexpr (kQuant != kQuantNone) {
      if (quantise) Fp8StoreScales<kQuant>(sc, dst_row, row_bytes, v0, v1, lane);
    }
  }
}


}  // namespace mori::ep::dev
