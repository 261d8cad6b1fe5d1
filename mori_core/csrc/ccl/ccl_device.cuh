// Device helpers of the SM collectives: block work ranges, unrolled copies, the
// per-block flag barrier with a bounded wait, the epoch, and the sum of each dtype.
// System-scope flags, the timer and bf16 rounding come from the EP kernels' primitives.
#pragma once

#include <cstdint>

#include "ccl/ccl_types.hpp"
#include "common/gpu_runtime.hpp"
#include "ops/device_primitives.hpp"

#if defined(MORI_GPU_HIP)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

namespace mori::ccl::dev {

using mori::ep::dev::Bf16ToFloat;
using mori::ep::dev::FloatToBf16;
using mori::ep::dev::GlobalTimerNs;
using mori::ep::dev::LoadAcquireSys;
using mori::ep::dev::ReachedRound;
using mori::ep::dev::StoreReleaseSys;

// [begin, end) of `n` units owned by this block: contiguous, the same on every rank
// (a peer's block b serves exactly what this rank's block b waits for).
__device__ __forceinline__ void BlockRange(uint64_t n, uint64_t& begin, uint64_t& end) {
  const uint64_t per = (n + gridDim.x - 1) / gridDim.x;
  begin = per * blockIdx.x < n ? per * blockIdx.x : n;
  end = begin + per < n ? begin + per : n;
}

// dst[i] = src[i] for i in [begin, end), four loads in flight per thread (peer reads over
// NVLink need many outstanding requests to reach bandwidth).
template <typename V>
__device__ __forceinline__ void CopyRange(V* __restrict__ dst, const V* __restrict__ src, uint64_t begin, uint64_t end) {
  constexpr int kUnroll = 4;
  const uint64_t stride = blockDim.x;
  uint64_t i = begin + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < end; i += kUnroll * stride) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < end; i += stride) dst[i] = src[i];
}

// The peer block b serves i-th: blocks start at different peers so every link carries traffic.
__device__ __forceinline__ int PeerAt(const SmSync& s, int i) {
  return (s.rank + 1 + (i + static_cast<int>(blockIdx.x)) % (s.npes - 1)) % s.npes;
}

// The epoch of the call this kernel serves (every block of the kernel reads the same value:
// only the last block of a finishing kernel advances it).
__device__ __forceinline__ uint32_t CallEpoch(const SmSync& s) {
  return *reinterpret_cast<volatile uint32_t*>(s.epoch) + 1;
}

__device__ __forceinline__ void AdvanceEpoch(const SmSync& s, uint32_t e) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(s.done, 1u) == gridDim.x - 1) {
      *reinterpret_cast<volatile uint32_t*>(s.done) = 0;
      *reinterpret_cast<volatile uint32_t*>(s.epoch) = e;
      __threadfence();
    }
  }
}

__device__ __forceinline__ void ReportTimeout(const SmSync& s, int peer, uint32_t e, uint32_t where) {
  if (atomicCAS(s.claim, 0u, 1u) != 0u) return;  // the first failure names the peer
  volatile ErrorRecord* r = s.error;
  r->peer = peer;
  r->block = static_cast<int32_t>(blockIdx.x);
  r->epoch = e;
  r->where = where;
  __threadfence_system();
  r->code = kErrTimeout;
  __threadfence_system();
}

// Per-block barrier `which` of epoch e with every peer. `signal`: publish this block's
// writes (made before the call) and tell every peer; `wait`: wait until every peer's block
// of the same index signalled e. Bounded by s.timeout_ns; returns false (the record names
// the peer) when a peer did not arrive. Every thread of the block must call it.
__device__ __forceinline__ bool Barrier(const SmSync& s, int which, uint32_t e, bool signal, bool wait,
                                        uint32_t where) {
  __syncthreads();
  int ok = 1;
  const int p = static_cast<int>(threadIdx.x);
  if (p < s.npes && p != s.rank) {
    if (signal) {
      __threadfence_system();
      StoreReleaseSys(s.peer_flags[which][p] + blockIdx.x * s.npes + s.rank, e);
    }
    if (wait) {
      const uint32_t* f = s.flags[which] + blockIdx.x * s.npes + p;
      uint64_t start = 0;
      while (!ReachedRound(LoadAcquireSys(f), e)) {
        const uint64_t now = GlobalTimerNs();
        if (start == 0) {
          start = now;
        } else if (now - start > s.timeout_ns) {
          ReportTimeout(s, p, e, where);
          ok = 0;
          break;
        }
      }
    }
  }
  return __syncthreads_and(ok) != 0;
}

// Sum of one element type: Acc is what the sum runs in (fp32 for floats, wrapping uint32
// for integers); every rank adds the sources in rank order, so all ranks agree bit for bit.
template <RedType R>
struct Sum;

template <>
struct Sum<RedType::kF32> {
  using Elem = float;
  using Acc = float;
  __device__ __forceinline__ static Acc Load(Elem v) { return v; }
  __device__ __forceinline__ static Elem Store(Acc a) { return a; }
  __device__ __forceinline__ static Acc Add(Acc a, Acc b) { return __fadd_rn(a, b); }
};

template <>
struct Sum<RedType::kBF16> {
  using Elem = uint16_t;
  using Acc = float;
  __device__ __forceinline__ static Acc Load(Elem v) { return Bf16ToFloat(v); }
  __device__ __forceinline__ static Elem Store(Acc a) { return FloatToBf16(a); }
  __device__ __forceinline__ static Acc Add(Acc a, Acc b) { return __fadd_rn(a, b); }
};

template <>
struct Sum<RedType::kF16> {
  using Elem = uint16_t;
  using Acc = float;
  __device__ __forceinline__ static Acc Load(Elem v) { return __half2float(__ushort_as_half(v)); }
  __device__ __forceinline__ static Elem Store(Acc a) { return __half_as_ushort(__float2half_rn(a)); }
  __device__ __forceinline__ static Acc Add(Acc a, Acc b) { return __fadd_rn(a, b); }
};

template <>
struct Sum<RedType::kI32> {
  using Elem = uint32_t;
  using Acc = uint32_t;
  __device__ __forceinline__ static Acc Load(Elem v) { return v; }
  __device__ __forceinline__ static Elem Store(Acc a) { return a; }
  __device__ __forceinline__ static Acc Add(Acc a, Acc b) { return a + b; }
};

// A 16-byte vector of elements.
template <RedType R>
union Vec16 {
  int4 raw;
  typename Sum<R>::Elem e[16 / sizeof(typename Sum<R>::Elem)];
};

// Sum of the sources in rank order (source 0 first, so all ranks agree bit for bit).
// kN > 0: the peer count is a compile-time constant, every source is loaded before the first
// add (the loads overlap); kN == 0: `npes` sources, loaded one after the other.
template <RedType R, int kN, typename Src>
__device__ __forceinline__ int4 SumVec(int npes, Src src) {
  using S = Sum<R>;
  constexpr int kE = 16 / sizeof(typename S::Elem);
  Vec16<R> v;
  typename S::Acc acc[kE];
  if constexpr (kN > 0) {
    Vec16<R> all[kN];
#pragma unroll
    for (int p = 0; p < kN; ++p) all[p].raw = src(p);
#pragma unroll
    for (int k = 0; k < kE; ++k) acc[k] = S::Load(all[0].e[k]);
#pragma unroll
    for (int p = 1; p < kN; ++p)
#pragma unroll
      for (int k = 0; k < kE; ++k) acc[k] = S::Add(acc[k], S::Load(all[p].e[k]));
  } else {
    v.raw = src(0);
#pragma unroll
    for (int k = 0; k < kE; ++k) acc[k] = S::Load(v.e[k]);
    for (int p = 1; p < npes; ++p) {
      v.raw = src(p);
#pragma unroll
      for (int k = 0; k < kE; ++k) acc[k] = S::Add(acc[k], S::Load(v.e[k]));
    }
  }
#pragma unroll
  for (int k = 0; k < kE; ++k) v.e[k] = S::Store(acc[k]);
  return v.raw;
}

template <RedType R, int kN, typename Src>
__device__ __forceinline__ typename Sum<R>::Elem SumElem(int npes, Src src) {
  using S = Sum<R>;
  const int n = kN > 0 ? kN : npes;
  typename S::Acc acc = S::Load(src(0));
#pragma unroll
  for (int p = 1; p < (kN > 0 ? kN : kMaxPeers); ++p)
    if (p < n) acc = S::Add(acc, S::Load(src(p)));
  return S::Store(acc);
}

}  // namespace mori::ccl::dev
