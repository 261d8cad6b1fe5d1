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
// ranks each (token, expert) among the round's tokens by the expert's token bitmap (the block set
// those bits itself; words shared with a neighbour's tokens are masked), and adds the round's
// counts. The block of the last token then holds the rank's per-expert totals and sends them
// with the dispatch's signal (receivers need them only after waiting for that signal).

// Before the block's first round: clears the other parity's bitmap words that its last use set
// (the next dispatch_standard_moe sets bits there) and sets s_cnt[e] = this rank's tokens before
// `begin` routed to expert e (a token listing e twice counts once).
__device__ __forceinline__ void StdFusedStart(const EpKernelArgs& a, const int32_t* ids, int begin, uint32_t parity,
                                              int32_t* s_cnt) {
  const EpGeometry& g = a.geo;
  const int ne = g.num_experts, words = g.tok_words, topk = g.topk, tid = threadIdx.x, T = blockDim.x;
  uint32_t* other = a.std.plan_bits + static_cast<size_t>(parity ^ 1) * ne * words;
  const int stale = a.buf.sync->plan_words[parity ^ 1];
  const int gtid = blockIdx.x * T + tid, gthreads = gridDim.x * T;
  for (int i = gtid; i < ne * stale; i += gthreads) other[static_cast<size_t>(i / stale) * words + i % stale] = 0;
  for (int e = tid; e < ne; e += T) s_cnt[e] = 0;
  __syncthreads();
  for (int t = tid; t < begin; t += T) {
    const int32_t* row = ids + static_cast<size_t>(t) * topk;
    for (int k = 0; k < topk; ++k) {
      const int e = row[k];
      bool first = e >= 0 && e < ne;
      for (int j = 0; j < k && first; ++j) first = row[j] != e;
      if (first) atomicAdd(s_cnt + e, 1);
    }
  }
  __syncthreads();
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

// StdTokenRel of the fused ranking: token t of the round starting at r0, whose bits the block set
// in `bits` (this dispatch's parity) and s_cnt counting the tokens before r0. Returns the mask of
// k entries that are their expert's first entry in the token (the caller adds those to s_cnt once
// every token of the round is ranked).
__device__ __forceinline__ uint64_t StdTokenRelFused(const EpKernelArgs& a, const uint32_t* bits,
                                                     const int32_t* s_cnt, int r0, int t, const int32_t* ids,
                                                     int32_t* rel) {
  const EpGeometry& g = a.geo;
  uint64_t firsts = 0;  // top-k is at most the warp size (64 on AMD)
  for (int k = 0; k < g.topk; ++k) {
    const int e = ids[k];
    int r = -1;
    if (e >= 0 && e < g.num_experts) {
      const int first = FirstEntryOf(ids, k, e);
      if (first < k) {
        r = rel[first];
      } else {
        r = s_cnt[e] + CountBitsIn(bits + static_cast<size_t>(e) * g.tok_words, r0, t);
        firsts |= 1ull << k;
      }
    }
    rel[k] = r;
  }
  return firsts;
}

// The expand of dispatch_standard_moe (StdExpandKernel, or the tail of the one-launch dispatch),
// once this rank's dispatch of `round` has waited for every source: every received row to each of
// its distinct local experts' [expert][position] slots. position = rows that earlier sources send
// to the expert (their counts, std_counts) + the row's position among its own source's rows of
// the expert (std_rel, written by the source's dispatch). Block 0 writes packed_count and the
// layout ranges. s_base: [world][experts_per_rank] shared ints.
__device__ __forceinline__ void StdExpandRows(const EpKernelArgs& a, int row_bytes, uint32_t round, int32_t* s_base) {
  const EpGeometry& g = a.geo;
  const int tid = threadIdx.x, T = blockDim.x, epr = g.experts_per_rank, ne = g.num_experts;
  const int32_t* counts = a.buf.std_counts + static_cast<size_t>(round & 1) * g.world * ne;
  for (int el = tid; el < epr; el += T) {
    const int e = g.rank * epr + el;
    int run = 0;
    for (int s = 0; s < g.world; ++s) {
      const int c = LoadRelaxedSys(counts + static_cast<size_t>(s) * ne + e);
      s_base[s * epr + el] = run;
      if (blockIdx.x == 0)
        a.std.layout_range[static_cast<size_t>(el) * g.world + s] =
            static_cast<int64_t>(static_cast<uint32_t>(c)) | (static_cast<int64_t>(run) << 32);
      run += c;
    }
    if (blockIdx.x == 0) a.std.packed_count[el] = run;
  }
  __syncthreads();
  // volatile: the one-launch tail's blocks read the sync state (its cache line) before its last block set it
  const int total = *reinterpret_cast<volatile int32_t*>(&a.buf.sync->total_recv);
  const int vecs = row_bytes / 16, lane = LaneId(), topk = g.topk;
  const int nwarps = T / kWarpSize;
  const int gwarp = blockIdx.x * nwarps + tid / kWarpSize, total_warps = gridDim.x * nwarps;
  int parts = max(1, total_warps / max(total, 1));
  parts = min(parts, max(1, vecs / kWarpSize));
  const int vpp = (vecs + parts - 1) / parts;
  for (int item = gwarp; item < total * parts; item += total_warps) {
    const int i = item % total, part = item / total;
    const int32_t flat = a.buf.src_pos[i];
    const int s = flat / g.max_send;
    // lane k: packed row of entry k (-1: not an expert of this rank), dup = repeats an earlier expert
    const int e = lane < topk ? a.buf.dispatch_out_indices[static_cast<size_t>(i) * topk + lane] : -1;
    const int rel = lane < topk ? a.std.std_rel[static_cast<size_t>(i) * topk + lane] : -1;
    bool dup = false;
    for (int j = 0; j < topk; ++j) {
      const int ej = ShflIdx(e, j);  // every lane shuffles (no short-circuit around it)
      dup |= j < lane && ej == e;
    }
    const int el = e - g.rank * epr;
    const int row = (rel >= 0 && el >= 0 && el < epr) ? el * g.tpe + s_base[s * epr + el] + rel : -1;
    if (part == 0) {
      if (lane < topk) a.std.std_row[static_cast<size_t>(i) * topk + lane] = row;
      if (row >= 0 && !dup) a.std.packed_src_info[row] = flat;
      if (g.scale_bytes > 0) {
        for (int k = 0; k < topk; ++k) {
          const int rk = ShflIdx(row, k), dk = ShflIdx(dup ? 1 : 0, k);
          if (rk < 0 || dk) continue;
          CopySmall(a.std.packed_scales + static_cast<size_t>(rk) * g.scale_bytes,
                    a.buf.dispatch_out_scales + static_cast<size_t>(i) * g.scale_bytes, g.scale_bytes, lane);
        }
      }
    }
    const int4* src = reinterpret_cast<const int4*>(a.buf.dispatch_out + static_cast<size_t>(i) * row_bytes);
    const int v1 = min(vecs, (part + 1) * vpp);
    constexpr int kUnroll = 4;
    for (int v0 = part * vpp; v0 < v1; v0 += kWarpSize * kUnroll) {
      int4 xv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + lane + u * kWarpSize;
        if (v < v1) xv[u] = LoadPeer(src + v);
      }
      for (int k = 0; k < topk; ++k) {
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
