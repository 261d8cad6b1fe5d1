// Device helpers shared by the dispatch and combine kernels: peer addressing,
// error reporting, bounded flag waits and the "last block to arrive" barrier.
// The helpers that take the kernel arguments are templates over their type, so
// that the inter-node kernels use them too with InterArgs (the same buf.sync,
// buf.error, geo.timeout_ns and peer_delta fields; its peers: the node's GPUs).
#pragma once

#include <type_traits>

#include "ops/device_primitives.hpp"
#include "ops/ep_types.hpp"

namespace mori::ep::dev {

// Byte distance from this rank's heap to peer pe's. Selected with an unrolled
// loop so a run-time `pe` never indexes the kernel-parameter array (which
// would copy the whole argument block to local memory).
template <typename Args>
__device__ __forceinline__ int64_t PeerDelta(const Args& a, int pe) {
  constexpr int kPeers = static_cast<int>(std::extent<decltype(Args::peer_delta)>::value);
  int64_t d = 0;
#pragma unroll
  for (int i = 0; i < kPeers; ++i)
    if (i == pe) d = a.peer_delta[i];
  return d;
}

// Address of `p`'s twin in peer `pe`'s heap.
template <typename Args, typename T>
__device__ __forceinline__ T* Peer(const Args& a, T* p, int pe) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) + PeerDelta(a, pe));
}

template <typename Args>
__device__ __forceinline__ bool OpFailed(const Args& a) {
  return *reinterpret_cast<volatile int32_t*>(&a.buf.sync->failed) != 0;
}

// Records the first error of the op in the host-visible record and marks the op
// failed, so that every other wait of this op bails out instead of timing out.
// Takes the two pointers it needs (not the kernel arguments) so that calling it
// never forces the argument block into local memory.
static __device__ __noinline__ void ReportErrorTo(EpSyncState* st, EpErrorRecord* err, int32_t code, int32_t phase,
                                           int32_t peer, int64_t x, int64_t y) {
  if (atomicCAS(&st->error_claim, 0, 1) == 0) {
    volatile EpErrorRecord* e = err;
    e->phase = phase;
    e->peer = peer;
    e->block = static_cast<int32_t>(blockIdx.x);
    e->a = x;
    e->b = y;
    FenceSys();
    e->code = code;
    FenceSys();
  }
  atomicExch(&st->failed, 1);
}

template <typename Args>
__device__ __forceinline__ void ReportError(const Args& a, int32_t code, int32_t phase, int32_t peer, int64_t x,
                                            int64_t y) {
  ReportErrorTo(a.buf.sync, a.buf.error, code, phase, peer, x, y);
}

// Spins until *flag has reached `round` << shift, at most `timeout_ns`. On timeout
// it reports which peer never arrived, with the rounds it had completed. Returns
// false on timeout or when another wait of this op already failed. shift > 0: the
// flag counts arrival units, 1 << shift per round (see kArriveShift).
static __device__ __noinline__ bool WaitRoundOn(const uint32_t* flag, uint32_t round, uint64_t timeout_ns, EpSyncState* st,
                                         EpErrorRecord* err, int phase, int peer, int shift = 0) {
  const uint32_t target = round << shift;
  if (ReachedRound(LoadAcquireSys(flag), target)) return true;
  const uint64_t start = GlobalTimerNs();
  uint32_t sleep_ns = 0;  // tight polls first (short waits stay short), then back off
  int tight = 2;
  while (true) {
    for (int i = 0; i < 8; ++i) {
      if (ReachedRound(LoadAcquireSys(flag), target)) return true;
      Backoff(sleep_ns);
    }
    if (tight > 0)
      --tight;
    else
      sleep_ns = sleep_ns == 0 ? 64 : (sleep_ns >= 1024 ? 1024 : sleep_ns * 2);
    if (*reinterpret_cast<volatile int32_t*>(&st->failed) != 0) return false;
    if (GlobalTimerNs() - start > timeout_ns) {
      const uint32_t seen = *reinterpret_cast<const volatile uint32_t*>(flag);
      // rounds completed: the target less the whole rounds still missing
      const uint32_t done = round - ((target - seen + (1u << shift) - 1) >> shift);
      ReportErrorTo(st, err, kErrTimeout, phase, peer, round, static_cast<int64_t>(shift ? done : seen));
      return false;
    }
  }
}

template <typename Args>
__device__ __forceinline__ bool WaitRound(const Args& a, const uint32_t* flag, uint32_t round, int phase, int peer,
                                          int shift = 0) {
  return WaitRoundOn(flag, round, a.geo.timeout_ns, a.buf.sync, a.buf.error, phase, peer, shift);
}

// Per-source arrival counters (kArriveShift, ep_types.hpp): each of the `blocks` blocks that arrive
// (blocks [0, blocks) of the launch) calls this once after its last write of the round (a barrier
// inside). Thread r < world orders the block's writes at system scope, then adds the block's share
// to `counter`'s twin on rank r (this rank's own included).
template <typename Args>
__device__ __forceinline__ void ArriveAtPeers(const Args& a, uint32_t* counter, int world, int blocks) {
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < world) {
    FenceSys();
    const uint32_t share = blockIdx.x == 0 ? (1u << kArriveShift) - static_cast<uint32_t>(blocks) + 1 : 1u;
    RedAddSys(Peer(a, counter, static_cast<int>(threadIdx.x)), share);
  }
}

// Every block calls this once after its last write of a phase. Returns true in
// exactly one block (the last to arrive), after all blocks' earlier writes,
// including those to peers, are ordered before it at system scope. Resets the
// counter for the next launch.
__device__ __forceinline__ bool ArriveLast(uint32_t* counter, int* s_flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    FenceSys();
    const uint32_t prev = atomicAdd(counter, 1u);
    const bool last = prev == gridDim.x - 1;
    if (last) {
      *counter = 0;
      FenceSys();
    }
    *s_flag = last ? 1 : 0;
  }
  __syncthreads();
  return *s_flag != 0;
}

// Copies `bytes` bytes from src to dst with the widest access both allow.
__device__ __forceinline__ void CopySmall(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
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

}  // namespace mori::ep::dev
