// Device helpers of the inter-node kernels: routing masks, the put-with-signal
// of staged network rows, bounded waits on NVSHMEM signal words, the
// block-wide slot reservation on node peers (the IntraNode scheme: one
// system-scope atomic per (block, peer)), and the kernels' launch. Node-peer
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

// Warp-collective: puts `rows` rows of `stride` bytes from src to dst on `pe`,
// then sets `pe`'s signal word `sig` to (round, rows); with no rows only the
// signal is set (every peer node waits for one, with 0 rows too).
__device__ __forceinline__ void PutRowsWithSignal(uint8_t* dst, const uint8_t* src, int rows, int stride, uint64_t* sig,
                                                  uint32_t round, int pe, int lane) {
  const uint64_t value = SignalValue(round, static_cast<uint32_t>(rows));
  if (rows > 0)
    nvshmemx_putmem_signal_nbi_warp(dst, src, static_cast<size_t>(rows) * stride, sig, value, NVSHMEM_SIGNAL_SET, pe);
  else if (lane == 0)
    nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_SET, pe);
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
