// The all-reduce (sum) kernels of MORI-CCL, templated on the dtype R, the access unit U
// (a 16-byte vector, or one element when the user's buffers are not 16-byte aligned) and
// kN, the rank count when it is 2, 4 or 8 (0: any count, read at run time). Included by
// one translation unit per dtype.
//   one-shot  push the input into every peer's slot of this rank, one barrier, reduce the
//             npes slots locally (latency: one hop);
//   two-shot  push shard p of the input into peer p's slot, reduce this rank's shard,
//             barrier, pull every peer's reduced shard (bandwidth: each byte crosses once
//             each way);
//   ce reduce the local step of the copy-engine all-reduce (the copies are not SM work).
#pragma once

#include "ccl/ccl_device.cuh"
#include "ccl/ccl_reduce_launch.hpp"

namespace mori::ccl::dev {

template <RedType R, int kN>
__device__ __forceinline__ int4 SumUnit(int npes, const int4* const* src, uint64_t j) {
  return SumVec<R, kN>(npes, [&](int p) { return src[p][j]; });
}
template <RedType R, int kN, typename E>
__device__ __forceinline__ E SumUnit(int npes, const E* const* src, uint64_t j) {
  return SumElem<R, kN>(npes, [&](int p) { return src[p][j]; });
}

// dst[k] = src[k] for the `len` elements: units [u0, u1) of this block, the tail by block 0.
template <RedType R, typename U>
__device__ __forceinline__ void CopyElems(uint8_t* dst, const uint8_t* src, uint64_t len, uint64_t u0, uint64_t u1) {
  using Elem = typename Sum<R>::Elem;
  constexpr uint64_t kE = sizeof(U) / sizeof(Elem);
  const uint64_t lu = len / kE;
  CopyRange(reinterpret_cast<U*>(dst), reinterpret_cast<const U*>(src), u0, u1 < lu ? u1 : lu);
  if (kE > 1 && blockIdx.x == 0)
    CopyRange(reinterpret_cast<Elem*>(dst), reinterpret_cast<const Elem*>(src), lu * kE, len);
}

// dst (and dst2 unless null) = sum over p of src[p], elements [0, len): units [u0, u1) of
// this block, the tail by block 0.
template <RedType R, typename U, int kN>
__device__ __forceinline__ void ReduceElems(int npes, const uint8_t* const* src, uint8_t* dst, uint8_t* dst2,
                                            uint64_t len, uint64_t u0, uint64_t u1) {
  using Elem = typename Sum<R>::Elem;
  constexpr uint64_t kE = sizeof(U) / sizeof(Elem);
  constexpr int kLoop = kN > 0 ? kN : kMaxPeers;
  const uint64_t lu = len / kE;
  const U* srcu[kLoop];
  const Elem* srce[kLoop];
#pragma unroll
  for (int p = 0; p < kLoop; ++p) {
    srcu[p] = p < npes ? reinterpret_cast<const U*>(src[p]) : nullptr;
    srce[p] = p < npes ? reinterpret_cast<const Elem*>(src[p]) : nullptr;
  }
  U* du = reinterpret_cast<U*>(dst);
  U* du2 = reinterpret_cast<U*>(dst2);
  const uint64_t end = u1 < lu ? u1 : lu;
  for (uint64_t j = u0 + threadIdx.x; j < end; j += blockDim.x) {
    const U v = SumUnit<R, kN>(npes, srcu, j);
    du[j] = v;
    if (du2) du2[j] = v;
  }
  if (kE > 1 && blockIdx.x == 0) {
    Elem* de = reinterpret_cast<Elem*>(dst);
    Elem* de2 = reinterpret_cast<Elem*>(dst2);
    for (uint64_t k = lu * kE + threadIdx.x; k < len; k += blockDim.x) {
      const Elem v = SumUnit<R, kN>(npes, srce, k);
      de[k] = v;
      if (de2) de2[k] = v;
    }
  }
}

template <RedType R, typename U, int kN>
__global__ void OneShotKernel(SmSync s, SmArgs a, int phase) {
  using Elem = typename Sum<R>::Elem;
  constexpr uint64_t kE = sizeof(U) / sizeof(Elem);
  const uint32_t e = CallEpoch(s);
  const uint64_t par = (e & 1u) ? a.buf_parity : 0;
  uint64_t u0, u1;
  BlockRange(a.count / kE, u0, u1);
  if (phase & kPhaseStart) {
    for (int i = 0; i < s.npes - 1; ++i) {
      const int p = PeerAt(s, i);
      CopyElems<R, U>(a.peer_buf[p] + par + s.rank * a.slot_bytes, a.in, a.count, u0, u1);
    }
  }
  const bool ok = Barrier(s, 0, e, phase & kPhaseStart, phase & kPhaseFinish, kSitePushed);
  if (phase & kPhaseFinish) {
    if (ok) {
      const uint8_t* src[kMaxPeers];
      for (int p = 0; p < s.npes; ++p) src[p] = p == s.rank ? a.in : a.buf + par + p * a.slot_bytes;
      ReduceElems<R, U, kN>(s.npes, src, a.out, nullptr, a.count, u0, u1);
    }
    AdvanceEpoch(s, e);
  }
}

__device__ __forceinline__ uint64_t ShardLen(uint64_t count, uint64_t shard, int p) {
  const uint64_t begin = static_cast<uint64_t>(p) * shard;
  if (begin >= count) return 0;
  return count - begin < shard ? count - begin : shard;
}

template <RedType R, typename U, int kN>
__global__ void TwoShotKernel(SmSync s, SmArgs a, int phase) {
  using Elem = typename Sum<R>::Elem;
  constexpr uint64_t kE = sizeof(U) / sizeof(Elem);
  constexpr uint64_t kEs = sizeof(Elem);
  const uint32_t e = CallEpoch(s);
  const uint64_t par = (e & 1u) ? a.buf_parity : 0;
  const uint64_t rpar = (e & 1u) ? a.red_parity : 0;
  uint64_t u0, u1;
  BlockRange(a.shard / kE, u0, u1);
  if (phase & kPhaseStart) {  // reduce-scatter: shard p of the input into peer p's slot of this rank
    for (int i = 0; i < s.npes - 1; ++i) {
      const int p = PeerAt(s, i);
      CopyElems<R, U>(a.peer_buf[p] + par + s.rank * a.slot_bytes, a.in + p * a.shard * kEs,
                      ShardLen(a.count, a.shard, p), u0, u1);
    }
  }
  bool ok = Barrier(s, 0, e, phase & kPhaseStart, phase & kPhaseFinish, kSitePushed);
  if (phase & kPhaseFinish) {
    if (ok) {
      const uint8_t* src[kMaxPeers];
      for (int p = 0; p < s.npes; ++p)
        src[p] = p == s.rank ? a.in + s.rank * a.shard * kEs : a.buf + par + p * a.slot_bytes;
      ReduceElems<R, U, kN>(s.npes, src, a.out + s.rank * a.shard * kEs, a.red + rpar,
                            ShardLen(a.count, a.shard, s.rank), u0, u1);
      ok = Barrier(s, 1, e, true, true, kSiteReduced);
      if (ok) {  // all-gather: pull every peer's reduced shard
        for (int i = 0; i < s.npes - 1; ++i) {
          const int p = PeerAt(s, i);
          CopyElems<R, U>(a.out + p * a.shard * kEs, a.peer_red[p] + rpar, ShardLen(a.count, a.shard, p), u0, u1);
        }
      }
    }
    AdvanceEpoch(s, e);
  }
}

template <RedType R, typename U, int kN>
__global__ void CeReduceKernel(CeReduceArgs a) {
  using Elem = typename Sum<R>::Elem;
  constexpr uint64_t kE = sizeof(U) / sizeof(Elem);
  constexpr uint64_t kEs = sizeof(Elem);
  const uint8_t* src[kMaxPeers];
  for (int p = 0; p < a.npes; ++p) src[p] = p == a.rank ? a.in + a.rank * a.shard * kEs : a.slots + p * a.slot_bytes;
  uint64_t u0, u1;
  BlockRange(a.len / kE, u0, u1);
  ReduceElems<R, U, kN>(a.npes, src, a.out + a.rank * a.shard * kEs, a.red, a.len, u0, u1);
}

template <RedType R, typename U, int kN>
void LaunchReduceKernel(const ReduceLaunch& l) {
  if (l.ce)
    CeReduceKernel<R, U, kN><<<l.grid, l.block, 0, l.stream>>>(*l.ce);
  else if (l.path == Path::kSmOneShot)
    OneShotKernel<R, U, kN><<<l.grid, l.block, 0, l.stream>>>(*l.sync, *l.args, l.phase);
  else
    TwoShotKernel<R, U, kN><<<l.grid, l.block, 0, l.stream>>>(*l.sync, *l.args, l.phase);
}

// Picks the access unit from the user buffers' alignment and kN from the rank count.
template <RedType R>
void LaunchReduceFor(const ReduceLaunch& l) {
  const uint8_t* in = l.ce ? l.ce->in : l.args->in;
  const uint8_t* out = l.ce ? l.ce->out : l.args->out;
  const int npes = l.ce ? l.ce->npes : l.sync->npes;
  const bool vec = ((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) % 16) == 0;
  if (!vec) return LaunchReduceKernel<R, typename Sum<R>::Elem, 0>(l);
  switch (npes) {
    case 2: return LaunchReduceKernel<R, int4, 2>(l);
    case 4: return LaunchReduceKernel<R, int4, 4>(l);
    case 8: return LaunchReduceKernel<R, int4, 8>(l);
    default: return LaunchReduceKernel<R, int4, 0>(l);
  }
}

}  // namespace mori::ccl::dev
