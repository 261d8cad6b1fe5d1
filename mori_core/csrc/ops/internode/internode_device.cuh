// Device helpers of the inter-node kernels: routing masks, node-peer addressing,
// bounded waits on NVSHMEM signal words, and the block-wide slot reservation on
// node peers (the IntraNode scheme: one system-scope atomic per (block, peer)).
// The spin-waits, error reporting and "last block" barrier are IntraNode's
// (ops/ep_device_common.hpp).
#pragma once

#include "ops/ep_device_common.hpp"
#include "ops/internode/internode_types.hpp"

namespace mori::ep::inter::dev {

using mori::ep::dev::kWarpSize;

// Byte distance to node peer l's heap, selected with an unrolled loop so a
// run-time index never spills the argument block to local memory.
__device__ __forceinline__ int64_t LocalDelta(const InterArgs& a, int l) {
  int64_t d = 0;
#pragma unroll
  for (int i = 0; i < kMaxLocal; ++i)
    if (i == l) d = a.peer_delta[i];
  return d;
}

template <typename T>
__device__ __forceinline__ T* OnPeer(const InterArgs& a, T* p, int l) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) + LocalDelta(a, l));
}

__device__ __forceinline__ bool Failed(const InterArgs& a) {
  return *reinterpret_cast<volatile int32_t*>(&a.buf.sync->failed) != 0;
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

__device__ __forceinline__ bool WaitLocalRound(const InterArgs& a, const uint32_t* flag, uint32_t round, int phase,
                                               int peer) {
  return mori::ep::dev::WaitRoundOn(flag, round, a.geo.timeout_ns, a.buf.sync, a.buf.error, phase, peer);
}

__device__ __forceinline__ void Report(const InterArgs& a, int32_t code, int32_t phase, int32_t peer, int64_t x,
                                       int64_t y) {
  mori::ep::dev::ReportErrorTo(a.buf.sync, a.buf.error, code, phase, peer, x, y);
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
    sm.base[tid] = run > 0 ? mori::ep::dev::AtomicAddSys(OnPeer(a, counter, tid), run) : 0;
  }
  __syncthreads();
#pragma unroll
  for (int l = 0; l < kMaxLocal; ++l) {
    int s = -1;
    if ((bits >> l) & 1u) {
      s = sm.base[l] + sm.warp_off[warp * kMaxLocal + l] + prefix[l];
      if (s >= a.geo.max_recv) {
        Report(a, kErrSendOverflow, phase, a.geo.node * a.geo.gpn + l, s, a.geo.max_recv);
        s = -1;
      }
    }
    slot[l] = s;
  }
  __syncthreads();  // warp_off/base are reused by the next round
}

// Copies `bytes` (a multiple of 4) with 16-byte accesses where both sides allow.
__device__ __forceinline__ void WarpCopy(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
  if ((align & 15) == 0) {
    for (int i = lane; i < bytes / 16; i += kWarpSize)
      reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
  } else if ((align & 3) == 0) {
    for (int i = lane; i < bytes / 4; i += kWarpSize)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
  } else {
    for (int i = lane; i < bytes; i += kWarpSize) dst[i] = src[i];
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
