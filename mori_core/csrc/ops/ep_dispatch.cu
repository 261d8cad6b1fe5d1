// IntraNode dispatch: every token goes once to each unique destination rank of
// its top-k experts, written straight into that rank's final receive buffers.
//
// Per block and round of up to blockDim tokens:
//   1. one thread per token builds its destination-rank mask (invalid ids dropped);
//   2. warp ballots count tokens per destination; one thread per destination
//      reserves a contiguous slot range with ONE system-scope atomic on that
//      rank's counter;
//   3. each token's slot on each destination = base + prefix;
//   4. warps copy (token, row-slice) items: 16-byte loads of the row once, stored
//      to every destination (payload), plus weights, ids, scales and source index.
// Completion: every block, once its writes are ordered, adds its share of the round
// to this source's arrival counter on every destination (ArriveAtPeers); block 0
// waits (bounded) until every source's blocks have all arrived; then the receive
// count is final, is published as total_recv, and the counter is reset for
// round + 2 (counters alternate by round parity, so back-to-back dispatches never
// race a reset). No block waits for the others of its own rank first, and no
// signal waits for the last one (#31 round 9).
//
// Standard-MoE mode (dispatch_standard_moe, kStd != kStdOff): either the plan
// kernel (ep_standard_moe.cu) already ranked this rank's tokens per expert and
// published the per-expert counts to every rank (kStdPlanned), or this kernel
// ranks them itself and the block of the last token sends the per-expert counts
// to every rank before its arrival, so they reach each peer before this rank's
// round signal (kStdFused, ep_std_layout.cuh: one launch and one cross-rank
// signal fewer). The rows travel exactly as in a plain dispatch (once per
// destination rank, into its 2-D receive buffer); in addition
// every (slot, k) of a local expert of the destination carries the row's position
// among this rank's rows of that expert (std_rel). The expand kernel on the
// receiving side then copies each received row to its final [local expert][row]
// slots (rows of earlier sources first), a local copy; kStdOneLaunch runs that
// copy as this kernel's tail instead (step 6, every block). Storing straight into the
// 3-D layout instead would send a token once per local expert of its destination
// (2.2x the NVLink bytes at EP4, top-8 of 256) and make every block wait for all
// sources' counts before it could send anything.
#include "ops/ep_device_common.hpp"
#include "ops/ep_kernels.hpp"
#include "ops/ep_profiler.cuh"
#include "ops/ep_std_layout.cuh"
#include "shmem/gpu_ext.hpp"

namespace mori::ep {
namespace dev {

// 16-byte vectors each lane loads before storing them to every destination:
// more bytes in flight per load latency; 4 at world 8 keeps 8 destination
// pointers and the vectors within 128 registers.
template <int kWorld>
struct DispatchUnroll {
  static constexpr int value = kWorld <= 4 ? 8 : 4;
};

// Step 5 on block 0, after every block's ArriveAtPeers: waits until every source's blocks (this
// rank's own included) have all arrived, then publishes the round's totals on this rank. False when
// a wait failed (reported). The other blocks end at their arrival; the kernel ends with this wait.
template <int kWorld, int kStd>
__device__ __forceinline__ bool DispatchComplete(const EpKernelArgs& a, const DispatchParams& p, uint32_t round,
                                                 int32_t* counter, uint32_t plan_parity) {
  constexpr bool kRank = kStd == kStdFused || kStd == kStdOneLaunch;
  const EpGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  const int tid = threadIdx.x, n = p.num_tokens;
  MORI_PROF_BEGIN(a, kProfDispatchSignal, round);
  bool ok = true;
  if (tid < g.world) ok = WaitRound(a, a.buf.dispatch_flags + tid, round, kPhaseDispatch, tid, kArriveShift);
  if (!__syncthreads_and(ok)) return false;
  if (tid == 0) {
    // Every source reserved its slots before its blocks arrived, so the counter is final.
    int total = *reinterpret_cast<volatile int32_t*>(counter);
    *counter = 0;
    if (total > g.max_recv) {
      ReportError(a, kErrRecvOverflow, kPhaseDispatch, -1, total, g.max_recv);
      total = g.max_recv;
    }
    st->total_recv = total;
    st->dispatch_tokens = n;
    st->dispatch_weighted = p.weights != nullptr;
    if (kStd != kStdOff) st->std_round = round;
    if (kRank) {  // every block read both at its start, before its arrival
      st->plan_words[plan_parity] = (n + 31) >> 5;
      st->plan_words[plan_parity ^ 1] = 0;
      st->std_plans += 1;
    }
    if constexpr (kStd == kStdOneLaunch)
      StoreReleaseSys(&st->dispatch_epoch, round);  // the other blocks wait for it (step 6)
    else
      st->dispatch_epoch = round;
  }
  if constexpr (kStd == kStdOneLaunch) __syncthreads();  // this block's step 6 reads the totals
  MORI_PROF_END(a, kProfDispatchSignal, round);
  return true;
}

template <int kWorld, int kStd>
__global__ void __launch_bounds__(kDispatchMaxThreads, 1) DispatchKernel(EpKernelArgs a, DispatchParams p) {
  constexpr bool kRank = kStd == kStdFused || kStd == kStdOneLaunch;  // ranks its own tokens
  extern __shared__ int4 smem_raw[];
  const int T = blockDim.x, tid = threadIdx.x, lane = LaneId();
  const int warp = tid / kWarpSize, nwarps = T / kWarpSize;
  int32_t* s_slot = reinterpret_cast<int32_t*>(smem_raw);      // [T][kWorld]
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_slot + T * kWorld);  // [T]
  int32_t* s_warp_off = reinterpret_cast<int32_t*>(s_mask + T);  // [32][kWorld]
  int32_t* s_base = s_warp_off + 32 * kWorld;                    // [kWorld]
  const EpGeometry& g = a.geo;
  // standard MoE only: [T][topk] position of each (token, k) among this rank's rows of expert k
  int32_t* s_rel = s_base + kWorld;
  // kStdFused / kStdOneLaunch only: [num_experts] this rank's tokens before the current round, per
  // expert; the one-launch tail reuses it as the expand's [world][experts_per_rank] bases
  int32_t* s_cnt = s_rel + T * g.topk;

  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const uint32_t round = st->dispatch_epoch + 1;
  int32_t* counter = a.buf.recv_counter + (round & 1);
  constexpr int kDispatchUnroll = DispatchUnroll<kWorld>::value;
  const int world = g.world, n = p.num_tokens, vecs = p.row_bytes / 16;
  // tokens per block; the one-launch standard-MoE dispatch has more blocks than senders (its expand tail)
  const int chunk = kStd == kStdOneLaunch ? (n + p.send_blocks - 1) / p.send_blocks : (n + gridDim.x - 1) / gridDim.x;
  const int begin = min(n, static_cast<int>(blockIdx.x) * chunk), end = min(n, begin + chunk);
  const int last_block = n > 0 ? (n - 1) / chunk : 0;  // the block of the last token (block 0 without tokens)
  // kRank: this dispatch's token bitmaps (parity of the standard-MoE dispatches so far)
  const uint32_t plan_parity = kRank ? (st->std_plans & 1) : 0;
  uint32_t* plan_bits = a.std.plan_bits + static_cast<size_t>(plan_parity) * g.num_experts * g.tok_words;
  if constexpr (kRank) StdFusedStart(a, plan_parity, s_cnt);  // blocks without tokens export zeros

  for (int r0 = begin; r0 < end; r0 += T) {
    MORI_PROF_BEGIN(a, kProfDispatchRoute, round);
    const int cnt = min(T, end - r0);
    // kRank: a round of a few tokens is ranked from its ids in shared memory, a larger one by bitmaps
    const bool small_round = kRank && cnt <= kDirectRankTokens && cnt * g.topk <= T;
    // 1. destination mask, one thread per token
    uint32_t mask = 0;
    if constexpr (kRank) MORI_PROF_BEGIN(a, kProfStdBits, round);
    if (tid < cnt) {
      const int32_t* ids = p.indices + static_cast<size_t>(r0 + tid) * g.topk;
      for (int k = 0; k < g.topk; ++k) {
        const int e = ids[k];
        if (e >= 0 && e < g.num_experts) mask |= 1u << (e / g.experts_per_rank);
        if (small_round) s_rel[tid * g.topk + k] = e;
      }
      a.buf.token_mask[r0 + tid] = mask;
    }
    if constexpr (kRank) {
      if (!small_round) StdSetRoundBits(a, plan_bits, p.indices, r0, cnt);
      MORI_PROF_END(a, kProfStdBits, round);
    }
    s_mask[tid] = mask;
    {  // the rows start moving into L2 while the slot reservation below is in flight
      const uint8_t* rows = p.input + static_cast<size_t>(r0) * p.row_bytes;
      const int lines = (cnt * p.row_bytes) >> 7;
      for (int l = tid; l < lines; l += T) PrefetchL2(rows + (static_cast<size_t>(l) << 7));
    }
    int prefix[kWorld];
#pragma unroll
    for (int r = 0; r < kWorld; ++r) {
      const LaneMask b = Ballot((mask >> r) & 1u);
      prefix[r] = PopCount(b & LanesBelow(lane));
      if (lane == 0) s_warp_off[warp * kWorld + r] = PopCount(b);
    }
    __syncthreads();
    // 2. one remote slot reservation per (block, destination); the standard-MoE ranking runs
    // while the reservations are in flight (the result is read only after it)
    int reserved = 0;
    if (tid < world) {
      int run = 0;
      for (int w = 0; w < nwarps; ++w) {
        const int c = s_warp_off[w * kWorld + tid];
        s_warp_off[w * kWorld + tid] = run;
        run += c;
      }
      reserved = run > 0 ? AtomicAddSys(Peer(a, counter, tid), run) : 0;
    }
    if constexpr (kRank) {
      if (r0 == begin) {  // uniform: the tokens before this block, counted while the reservations fly
        MORI_PROF_BEGIN(a, kProfStdPlan, round);
        // not by warp 0, whose lanes issued the reservations: its loads would wait for their replies
        CountFirstEntries(a, s_cnt, p.indices, begin, nwarps > 1 ? kWarpSize : 0);
        __syncthreads();
        MORI_PROF_END(a, kProfStdPlan, round);
      }
      MORI_PROF_BEGIN(a, kProfStdRank, round);
      if (small_round)
        StdRankSmallRound(a, s_cnt, cnt, s_rel);
      else
        StdRankRound(a, plan_bits, s_cnt, p.indices, r0, cnt, s_rel);
      MORI_PROF_END(a, kProfStdRank, round);
    }
    if (tid < world) s_base[tid] = reserved;
    __syncthreads();
    // 3. slot of each token on each destination
    if (tid < cnt) {
      const size_t t = static_cast<size_t>(r0 + tid);
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        if (r < world) {
          int slot = -1;
          if ((mask >> r) & 1u) {
            slot = s_base[r] + s_warp_off[warp * kWorld + r] + prefix[r];
            if (slot >= g.max_recv) {
              ReportError(a, kErrSendOverflow, kPhaseDispatch, r, slot, g.max_recv);
              slot = -1;
            }
          }
          s_slot[tid * kWorld + r] = slot;
          a.buf.dest_slot[t * world + r] = slot;
        }
      }
      if constexpr (kStd == kStdPlanned)
        StdTokenRel(a, (st->std_plans + 1) & 1, static_cast<int>(t), p.indices + t * g.topk, s_rel + tid * g.topk);
    }
    __syncthreads();
    MORI_PROF_END(a, kProfDispatchRoute, round);
    MORI_PROF_BEGIN(a, kProfDispatchCopy, round);
    // 4. copy (token, slice) items; slices keep all warps busy when tokens are few. With
    // per_dest (large grids), an item is (token, slice, destination): a warp stores to one rank,
    // and the warps next to it load the same slice (from L2) for the token's other destinations.
    // A pure copy kernel moves 8-15 % more over NVLink that way at EP4 than when one warp loads
    // a slice once and stores it to every destination (link probe, `bench ccl --ceilings`), and
    // the dispatch keeps speeding up with more warps instead of slowing down (docs/ep.md, #31
    // round 8). On small grids each warp's loads are then exposed: one slice loaded per store.
    const int fan = p.per_dest ? world : 1;
    int parts = max(1, nwarps / (cnt * fan));
    parts = min(parts, max(1, vecs / kWarpSize));
    const int vpp = (vecs + parts - 1) / parts;
    const int items = cnt * parts * fan;
    for (int item = warp; item < items; item += nwarps) {
      const int sel = item % fan, li = (item / fan) % cnt, part = item / (fan * cnt);
      const size_t t = static_cast<size_t>(r0 + li);
      int4* dst[kWorld];
      int slot_of[kWorld];
      bool on[kWorld];
      bool any = false;
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        slot_of[r] = r < world && (fan == 1 || r == sel) ? s_slot[li * kWorld + r] : -1;
        on[r] = slot_of[r] >= 0;
        any |= on[r];
        dst[r] = reinterpret_cast<int4*>(Peer(a, a.buf.dispatch_out, r) + static_cast<size_t>(max(slot_of[r], 0)) * p.row_bytes);
      }
      if (!any) continue;  // per_dest: the token does not go to this item's rank
      const int4* src = reinterpret_cast<const int4*>(p.input + t * p.row_bytes);
      const int v1 = min(vecs, (part + 1) * vpp);
      for (int v = part * vpp + lane; v < v1; v += kWarpSize * kDispatchUnroll) {
        int4 x[kDispatchUnroll];
#pragma unroll
        for (int u = 0; u < kDispatchUnroll; ++u)
          if (v + u * kWarpSize < v1) x[u] = LoadStream(src + v + u * kWarpSize);
#pragma unroll
        for (int r = 0; r < kWorld; ++r) {
          if (!on[r]) continue;
#pragma unroll
          for (int u = 0; u < kDispatchUnroll; ++u)
            if (v + u * kWarpSize < v1) Store16(dst[r] + v + u * kWarpSize, x[u]);
        }
      }
      if (part != 0) continue;
      // standard MoE: lane k knows entry k's position among this rank's rows of its expert and the
      // rank that expert lives on
      const int my_rel = kStd != kStdOff && lane < g.topk ? s_rel[li * g.topk + lane] : -1;
      const int my_rank = my_rel >= 0 ? p.indices[t * g.topk + lane] / g.experts_per_rank : -1;
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        if (!on[r]) continue;
        const size_t slot = static_cast<size_t>(slot_of[r]);
        if (lane < g.topk) {
          if (p.weights)
            Peer(a, a.buf.dispatch_out_weights, r)[slot * g.topk + lane] = p.weights[t * g.topk + lane];
          Peer(a, a.buf.dispatch_out_indices, r)[slot * g.topk + lane] = p.indices[t * g.topk + lane];
          if (kStd != kStdOff) Peer(a, a.std.std_rel, r)[slot * g.topk + lane] = my_rank == r ? my_rel : -1;
        }
        if (p.scales)
          CopySmall(Peer(a, a.buf.dispatch_out_scales, r) + slot * g.scale_bytes, p.scales + t * g.scale_bytes,
                    g.scale_bytes, lane);
        if (lane == 0) Peer(a, a.buf.src_pos, r)[slot] = g.rank * g.max_send + static_cast<int32_t>(t);
      }
    }
    MORI_PROF_END(a, kProfDispatchCopy, round);
    if constexpr (kRank) {
      // The round's tokens join s_cnt only where a later read needs them: this block's next
      // round, or the count export of the block of the last token. After this warp's rows, so
      // that the update never waits behind the other warps' NVLink stores before its own.
      if (r0 + T < end || static_cast<int>(blockIdx.x) == last_block) {
        MORI_PROF_BEGIN(a, kProfStdCount, round);
        CountFirstEntries(a, s_cnt, p.indices + static_cast<size_t>(r0) * g.topk, cnt);
        MORI_PROF_END(a, kProfStdCount, round);
      }
    }
    __syncthreads();
  }

  if constexpr (kRank) {
    // The block of the last token (block 0 without tokens) has counted them all: every rank gets
    // this rank's counts of its experts, ordered before the round signal by the arrival below.
    if (static_cast<int>(blockIdx.x) == last_block) {
      int32_t* mine = a.buf.std_counts + (static_cast<size_t>(round & 1) * world + g.rank) * g.num_experts;
      for (int e = tid; e < g.num_experts; e += T) *Peer(a, mine + e, e / g.experts_per_rank) = s_cnt[e];
    }
  }

  // 5. completion. Every rank learns every source's token count with the round (the staged push
  // combine cuts each source's tokens into chunks the same way on both sides); by round parity,
  // because a peer may publish its next round's count while this rank's combine still reads this
  // one's. Block 0 writes them before its arrival, which orders them.
  if (blockIdx.x == 0 && tid < world) *Peer(a, a.buf.peer_tokens + (round & 1) * kMaxWorld + g.rank, tid) = n;
  ArriveAtPeers(a, a.buf.dispatch_flags + g.rank, world, gridDim.x);
  if (blockIdx.x == 0 && !DispatchComplete<kWorld, kStd>(a, p, round, counter, plan_parity)) return;
  if constexpr (kStd == kStdOneLaunch) {
    // 6. the expand (StdExpandRows) on every block once block 0 has waited for every source and
    // published the totals. The grid is co-resident (the host sizes it), so the blocks waiting
    // here cannot keep block 0 from running. They wait for the sources first, so that a missing
    // peer is reported as such.
    bool ok = true;
    if (blockIdx.x != 0) {
      if (tid < world) ok = WaitRound(a, a.buf.dispatch_flags + tid, round, kPhaseDispatch, tid, kArriveShift);
      if (__syncthreads_and(ok) && tid == 0) ok = WaitRound(a, &st->dispatch_epoch, round, kPhaseDispatch, g.rank);
    }
    if (!__syncthreads_and(ok)) return;
    MORI_PROF_BEGIN(a, kProfStdExpand, round);
    StdExpandRows(a, p.row_bytes, round, s_cnt);
    MORI_PROF_END(a, kProfStdExpand, round);
  }
}

}  // namespace dev

size_t DispatchSmemBytes(int threads, int world, int standard_moe, int num_experts, int topk) {
  const size_t base = static_cast<size_t>(threads) * world + threads + 32 * world + world;
  const size_t std_part = standard_moe != kStdOff ? static_cast<size_t>(threads) * topk : 0;
  const size_t fused_part = standard_moe >= kStdFused ? static_cast<size_t>(num_experts) : 0;
  return sizeof(int32_t) * (base + std_part + fused_part);
}

namespace dev {

using DispatchKernelPtr = void (*)(EpKernelArgs, DispatchParams);

// The kernel of `standard_moe` (EpStdMode), allowed `smem` bytes of dynamic shared memory.
template <int kWorld>
DispatchKernelPtr DispatchKernelFor(int standard_moe, size_t smem) {
  const DispatchKernelPtr kernel = standard_moe == kStdOneLaunch ? DispatchKernel<kWorld, kStdOneLaunch>
                                   : standard_moe == kStdFused   ? DispatchKernel<kWorld, kStdFused>
                                   : standard_moe == kStdPlanned ? DispatchKernel<kWorld, kStdPlanned>
                                                                 : DispatchKernel<kWorld, kStdOff>;
  if (smem > 48 * 1024) MORI_GPU_CHECK(gpuFuncSetMaxDynamicSmem(kernel, static_cast<int>(smem)));
  return kernel;
}

template <int kWorld>
void LaunchDispatchWorld(const EpKernelArgs& args, const DispatchParams& params, int blocks, int threads, size_t smem,
                         gpuStream_t stream) {
  if (params.standard_moe != kStdOff)
    DispatchKernelFor<kWorld>(params.standard_moe, smem)<<<blocks, threads, smem, stream>>>(args, params);
  else
    DispatchKernel<kWorld, kStdOff><<<blocks, threads, smem, stream>>>(args, params);
}

}  // namespace dev

int KernelWarpSize() { return dev::kWarpSize; }

void LaunchDispatch(const EpKernelArgs& args, const DispatchParams& params, int blocks, int warps, gpuStream_t stream) {
  const int threads = warps * dev::kWarpSize;
  const int w = args.geo.world <= 2 ? 2 : (args.geo.world <= 4 ? 4 : 8);
  const size_t smem = DispatchSmemBytes(threads, w, params.standard_moe, args.geo.num_experts, args.geo.topk);
  if (w == 2)
    dev::LaunchDispatchWorld<2>(args, params, blocks, threads, smem, stream);
  else if (w == 4)
    dev::LaunchDispatchWorld<4>(args, params, blocks, threads, smem, stream);
  else
    dev::LaunchDispatchWorld<8>(args, params, blocks, threads, smem, stream);
  MORI_GPU_CHECK(gpuGetLastError());
}

int DispatchMaxCoResidentBlocks(int world, int standard_moe, int num_experts, int topk, int warps, int device) {
  DeviceGuard guard(device);
  const int threads = warps * dev::kWarpSize;
  const int w = world <= 2 ? 2 : (world <= 4 ? 4 : 8);
  const size_t smem = DispatchSmemBytes(threads, w, standard_moe, num_experts, topk);
  const dev::DispatchKernelPtr kernel = w == 2   ? dev::DispatchKernelFor<2>(standard_moe, smem)
                                        : w == 4 ? dev::DispatchKernelFor<4>(standard_moe, smem)
                                                 : dev::DispatchKernelFor<8>(standard_moe, smem);
  int per_sm = 0, sms = 0;
  MORI_GPU_CHECK(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  MORI_GPU_CHECK(gpuDeviceGetAttribute(&sms, gpuDevAttrMultiProcessorCount, device));
  return per_sm * sms;
}

}  // namespace mori::ep
