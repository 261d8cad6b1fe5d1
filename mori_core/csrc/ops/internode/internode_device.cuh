// Device helpers of the inter-node kernels: routing masks, the signals of the
// network rows (a release store to a direct peer, an NVSHMEM signal to a put
// peer), bounded waits on the signal words, unrolled row copies, the phase
// timestamps, the block-wide reservations of node-peer slots (the IntraNode
// scheme: one system-scope atomic per (block, peer)) and of network rows (one
// atomic per (block, node)), and the kernels' launch. Node-peer
// addressing, the spin-waits, error reporting and the "last block" barrier are
// IntraNode's (ops/ep_device_common.hpp), used here with InterArgs: its peers
// are the GPUs of this node.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "ops/ep_device_common.hpp"
#include "ops/internode/internode_kernels.hpp"
#include "ops/internode/internode_types.hpp"

namespace mori::ep::inter::dev {

using mori::ep::dev::ArriveLast;
using mori::ep::dev::Bf16Tag;
using mori::ep::dev::CopySmall;
using mori::ep::dev::FenceSys;
using mori::ep::dev::kWarpSize;
using mori::ep::dev::LoadPeer;
using mori::ep::dev::LoadStream;
using mori::ep::dev::OpFailed;
using mori::ep::dev::Peer;
using mori::ep::dev::ReportError;
using mori::ep::dev::Store16;
using mori::ep::dev::StoreReleaseSys;
using mori::ep::dev::VecTraits;
using mori::ep::dev::WaitRound;

// The round a launch works on: one past the last completed round of its phase
// (`epoch`), and its parity, which selects the half of the double-buffered
// state (slot counters, network areas, signal words) that the round uses.
struct Round {
  uint32_t round;
  int par;
};

__device__ __forceinline__ Round NextRound(uint32_t epoch) {
  const uint32_t round = epoch + 1;
  return {round, static_cast<int>(round & 1)};
}

__device__ __forceinline__ uint64_t RankMask(const int32_t* ids, const InterGeometry& g) {
  uint64_t m = 0;
  for (int k = 0; k < g.topk; ++k) {
    const int e = ids[k];
    if (e >= 0 && e < g.num_experts) m |= 1ull << (e / g.experts_per_rank);
  }
  return m;
}

// Destinations of `mask` on this node, as bits of local ranks.
__device__ __forceinline__ uint32_t LocalBits(uint64_t mask, const InterGeometry& g) {
  return static_cast<uint32_t>(mask >> (g.node * g.gpn)) & ((1u << g.gpn) - 1u);
}

__device__ __forceinline__ bool HitsNode(uint64_t mask, int node, const InterGeometry& g) {
  return ((mask >> (node * g.gpn)) & ((1ull << g.gpn) - 1ull)) != 0;
}

__device__ __forceinline__ uint64_t LoadAcquireSys64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t SignalValue(uint32_t round, uint32_t rows) {
  return (static_cast<uint64_t>(round) << 32) | rows;
}

__device__ __forceinline__ void StoreReleaseSys64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Records phase point `pt` of round `round` (dispatch: dir 0, combine: dir 1).
__device__ __forceinline__ void RecordPhase(const InterArgs& a, int dir, int pt, uint32_t round) {
  a.buf.phase_ns[(static_cast<size_t>(dir) * kPhaseRing + (round % kPhaseRing)) * kPhasePoints + pt] =
      static_cast<int64_t>(mori::ep::dev::GlobalTimerNs());
}

// `p` (inside this rank's NVSHMEM allocation) as node m's proxy sees it, through the
// load/store mapping `delta` (s_delta[m]); only for direct peers (delta != 0).
template <typename T>
__device__ __forceinline__ T* NetPeer(T* p, int64_t delta) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) + delta);
}

// Signals node m's proxy that this rank's rows of `round` are in place: a
// release store through the mapping for a direct peer, an NVSHMEM signal for a
// put peer (after the caller's nvshmem_quiet completed the puts). One thread.
__device__ __forceinline__ void SignalNode(uint64_t* sig, uint32_t round, int rows, int64_t delta, int pe) {
  const uint64_t value = SignalValue(round, static_cast<uint32_t>(rows));
  if (delta != 0)
    StoreReleaseSys64(NetPeer(sig, delta), value);
  else
    nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_SET, pe);
}

// A 16-byte vector of a source row: the read-only input (non-coherent path) or
// memory a peer wrote (coherent load).
template <bool kStreamSrc>
__device__ __forceinline__ int4 LoadVec(const int4* p) {
  return kStreamSrc ? LoadStream(p) : LoadPeer(p);
}

// Copies 16-byte vectors [v0, v1) of a row: lanes keep kUnroll loads in flight
// before storing (one pointer per destination).
template <int kUnroll, bool kStreamSrc>
__device__ __forceinline__ void CopyVecs(int4* dst, const int4* src, int v0, int v1, int lane) {
  for (int v = v0 + lane; v < v1; v += kWarpSize * kUnroll) {
    int4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v + u * kWarpSize < v1) x[u] = LoadVec<kStreamSrc>(src + v + u * kWarpSize);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v + u * kWarpSize < v1) Store16(dst + v + u * kWarpSize, x[u]);
  }
}

// Copies vectors [v0, v1) of `src` to every node peer l with on[l] (at dst[l]).
template <int kUnroll, bool kStreamSrc>
__device__ __forceinline__ void CopyVecsToPeers(int4* const (&dst)[kMaxLocal], const bool (&on)[kMaxLocal],
                                                const int4* src, int v0, int v1, int lane) {
  for (int v = v0 + lane; v < v1; v += kWarpSize * kUnroll) {
    int4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v + u * kWarpSize < v1) x[u] = LoadVec<kStreamSrc>(src + v + u * kWarpSize);
#pragma unroll
    for (int l = 0; l < kMaxLocal; ++l) {
      if (!on[l]) continue;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v + u * kWarpSize < v1) Store16(dst[l] + v + u * kWarpSize, x[u]);
    }
  }
}

// Waits until the signal word carries `round` (upper 32 bits), bounded by the
// op's timeout; returns the row count (lower 32 bits) or -1 after reporting
// the missing peer (or when another wait of the op already failed).
static __device__ __noinline__ int WaitSignal(const uint64_t* sig, uint32_t round, uint64_t timeout_ns, EpSyncState* st,
                                              EpErrorRecord* err, int phase, int peer) {
  uint64_t v = LoadAcquireSys64(sig);
  if (static_cast<uint32_t>(v >> 32) == round) return static_cast<int>(v & 0xffffffffu);
  const uint64_t start = mori::ep::dev::GlobalTimerNs();
  uint32_t sleep_ns = 64;
  while (true) {
    for (int i = 0; i < 8; ++i) {
      v = LoadAcquireSys64(sig);
      if (static_cast<uint32_t>(v >> 32) == round) return static_cast<int>(v & 0xffffffffu);
      mori::ep::dev::Backoff(sleep_ns);
    }
    sleep_ns = sleep_ns >= 1024 ? 1024 : sleep_ns * 2;
    if (*reinterpret_cast<volatile int32_t*>(&st->failed) != 0) return -1;
    if (mori::ep::dev::GlobalTimerNs() - start > timeout_ns) {
      mori::ep::dev::ReportErrorTo(st, err, kErrTimeout, phase, peer, round, static_cast<int64_t>(v >> 32));
      return -1;
    }
  }
}

// Shared memory of ReserveOnNodePeers.
struct ReserveSmem {
  int32_t warp_off[32 * kMaxLocal];
  int32_t base[kMaxLocal];
};

// Block-wide slot reservation: thread tid holds `bits` (node peers its row goes
// to; 0 for idle threads). Reserves contiguous slot ranges with one system-scope
// atomic per (block, peer) on the peers' `counter`, and returns this thread's
// slot on every peer in slot[] (-1 where none or over capacity, reported).
__device__ __forceinline__ void ReserveOnNodePeers(const InterArgs& a, uint32_t bits, int32_t* counter,
                                                   ReserveSmem& sm, int32_t (&slot)[kMaxLocal], int phase) {
  const int tid = threadIdx.x, lane = mori::ep::dev::LaneId(), warp = tid / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  int prefix[kMaxLocal];
#pragma unroll
  for (int l = 0; l < kMaxLocal; ++l) {
    const auto b = mori::ep::dev::Ballot((bits >> l) & 1u);
    prefix[l] = mori::ep::dev::PopCount(b & mori::ep::dev::LanesBelow(lane));
    if (lane == 0) sm.warp_off[warp * kMaxLocal + l] = mori::ep::dev::PopCount(b);
  }
  __syncthreads();
  if (tid < a.geo.gpn) {
    int run = 0;
    for (int w = 0; w < nwarps; ++w) {
      const int c = sm.warp_off[w * kMaxLocal + tid];
      sm.warp_off[w * kMaxLocal + tid] = run;
      run += c;
    }
    sm.base[tid] = run > 0 ? mori::ep::dev::AtomicAddSys(Peer(a, counter, tid), run) : 0;
  }
  __syncthreads();
#pragma unroll
  for (int l = 0; l < kMaxLocal; ++l) {
    int s = -1;
    if ((bits >> l) & 1u) {
      s = sm.base[l] + sm.warp_off[warp * kMaxLocal + l] + prefix[l];
      if (s >= a.geo.max_recv) {
        ReportError(a, kErrSendOverflow, phase, a.geo.node * a.geo.gpn + l, s, a.geo.max_recv);
        s = -1;
      }
    }
    slot[l] = s;
  }
  __syncthreads();  // warp_off/base are reused by the next round
}

// ReserveOnNodePeers for a block's batch of rows (this thread's row, if
// has_row, goes to the node peers in `bits`), recording the row's slots in
// row_slot (shared: read by the warp that copies the row) and in
// table[at + l] for the node peers l < gpn (read by the combine).
__device__ __forceinline__ void ReserveRow(const InterArgs& a, uint32_t bits, int32_t* counter, ReserveSmem& sm,
                                           bool has_row, int32_t (&row_slot)[kMaxLocal], int32_t* table, size_t at,
                                           int phase) {
  int32_t slot[kMaxLocal];
  ReserveOnNodePeers(a, bits, counter, sm, slot, phase);
  if (has_row) {
#pragma unroll
    for (int l = 0; l < kMaxLocal; ++l) {
      row_slot[l] = slot[l];
      if (l < a.geo.gpn) table[at + l] = slot[l];
    }
  }
}

// Shared memory of ReserveNodeRows.
struct NodeReserveSmem {
  int32_t warp_off[32][kMaxWorld];  // rows of each warp for node m, then its offset in the block's range
  int32_t base[kMaxWorld];          // first network row of this block's batch for node m
  int32_t run[kMaxWorld];           // network rows of this block's batch for node m
};

// Block-wide reservation of network rows: thread tid holds own token t (has)
// with destination mask `mask`; for every other node m it hits, the token gets
// network row j of node m (one atomic per (block, node) on net_counter[m], so
// a batch's rows for m are the contiguous range [base[m], base[m] + run[m]) in
// token order). Writes node_slot[t][m] (j or -1) and net_row_tok[m][j] = t.
__device__ __forceinline__ void ReserveNodeRows(const InterArgs& a, uint64_t mask, bool has, int t,
                                                NodeReserveSmem& sm) {
  const InterGeometry& g = a.geo;
  const int tid = threadIdx.x, lane = mori::ep::dev::LaneId(), warp = tid / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  for (int m = 0; m < g.nodes; ++m) {
    const auto b = mori::ep::dev::Ballot(has && m != g.node && HitsNode(mask, m, g));
    if (lane == 0) sm.warp_off[warp][m] = mori::ep::dev::PopCount(b);
  }
  __syncthreads();
  for (int m = tid; m < g.nodes; m += blockDim.x) {
    int run = 0;
    for (int w = 0; w < nwarps; ++w) {
      const int c = sm.warp_off[w][m];
      sm.warp_off[w][m] = run;
      run += c;
    }
    sm.run[m] = run;
    sm.base[m] = run > 0 ? atomicAdd(&a.buf.net_counter[m], run) : 0;
  }
  __syncthreads();
  for (int m = 0; m < g.nodes; ++m) {
    const bool hit = has && m != g.node && HitsNode(mask, m, g);
    const auto b = mori::ep::dev::Ballot(hit);
    if (!has) continue;
    int j = -1;
    if (hit) {
      j = sm.base[m] + sm.warp_off[warp][m] + mori::ep::dev::PopCount(b & mori::ep::dev::LanesBelow(lane));
      a.buf.net_row_tok[static_cast<size_t>(m) * g.max_tok + j] = t;
    }
    a.buf.node_slot[static_cast<size_t>(t) * g.nodes + m] = j;
  }
}

// Peer node at position `i` of a send order that starts at node `first` (mod nodes). Every
// rank's sends start with a different peer (first = own node + 1, + the block index in the
// dispatch), so the senders spread over the receivers at any moment. When every rank walked
// nodes 0, 1, 2, ... in lockstep, all senders wrote into the same node at once (its ingress the
// bottleneck, the others idle): round 1 on 4xH100 (EP4, one GPU per node, 4096 tokens) measured
// the send at about half of IntraNode's NVLink rate (IntraNode stores each token to all its
// peers at once), and the last node's rows arriving last ("wait peers").
__device__ __forceinline__ int SendOrderNode(int first, int i, int nodes) { return (first + i) % nodes; }

// Index of the item range [off[i], off[i + 1]) that holds `item` (off[0] = 0; empty ranges are
// skipped: the last i with off[i] <= item).
__device__ __forceinline__ int NodeOfItem(const int32_t* off, int nodes, int item) {
  int lo = 0, hi = nodes - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (off[mid] <= item)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Work split of `count` rows over `warps` warps: rows are cut into `parts`
// slices when there are fewer rows than warps (small batches).
struct Split {
  int parts, vpp, items;
  __device__ Split(int count, int warps, int vecs) {
    parts = max(1, warps / max(count, 1));
    parts = min(parts, max(1, vecs / kWarpSize));
    vpp = (vecs + parts - 1) / parts;
    items = count * parts;
  }
};

}  // namespace mori::ep::inter::dev

namespace mori::ep::inter {

// Launches one inter-node kernel with `warps` warps per block on `stream` and
// checks the launch.
template <typename Params>
void LaunchKernel(void (*kernel)(InterArgs, Params), const InterArgs& args, const Params& params, int blocks, int warps,
                  cudaStream_t stream) {
  kernel<<<blocks, warps * dev::kWarpSize, 0, stream>>>(args, params);
  MORI_GPU_CHECK(cudaGetLastError());
}

}  // namespace mori::ep::inter
