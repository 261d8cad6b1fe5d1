// Device-side primitives of the EP kernels, one definition per vendor: warp
// ballots, system-scope atomics/fences/acquire-release flags, a nanosecond
// timer for bounded waits, and 16-byte vector loads/stores.
#pragma once

#include <cstdint>

#include "common/gpu_runtime.hpp"

namespace mori::ep::dev {

#if defined(MORI_GPU_HIP)
constexpr int kWarpSize = 64;  // gfx9 wave64
using LaneMask = unsigned long long;

__device__ __forceinline__ int LaneId() { return __lane_id(); }
__device__ __forceinline__ LaneMask Ballot(bool p) { return __ballot(p); }
__device__ __forceinline__ int PopCount(LaneMask m) { return __popcll(m); }
__device__ __forceinline__ int LowestLane(LaneMask m) { return __ffsll(static_cast<long long>(m)) - 1; }
__device__ __forceinline__ LaneMask LanesBelow(int lane) {
  return lane == 0 ? 0ull : (~0ull >> (64 - lane));
}
__device__ __forceinline__ uint32_t WarpOr(uint32_t v) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v |= __shfl_xor(v, o);
  return v;
}
// s_memrealtime ticks at a constant 100 MHz on gfx9.
__device__ __forceinline__ uint64_t GlobalTimerNs() { return __builtin_amdgcn_s_memrealtime() * 10ull; }
__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ int32_t AtomicAddSys(int32_t* p, int32_t v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Adds without returning (fire and forget): a remote arrival count.
__device__ __forceinline__ void RedAddSys(uint32_t* p, uint32_t v) {
  (void)__hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// ORs without returning: bits this device reads later.
__device__ __forceinline__ void RedOrGpu(uint32_t* p, uint32_t v) {
  (void)__hip_atomic_fetch_or(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ void FenceSys() { __threadfence_system(); }
// Converges the wavefront and orders its lanes' memory operations (HIP has no __syncwarp).
__device__ __forceinline__ void SyncWarp() { __builtin_amdgcn_wave_barrier(); }
__device__ __forceinline__ void Backoff(uint32_t ns) {
  if (ns) __builtin_amdgcn_s_sleep(1);
}
__device__ __forceinline__ int ShflIdx(int v, int src) { return __shfl(v, src); }
__device__ __forceinline__ int ShflUp(int v, int d) { return __shfl_up(v, d); }
__device__ __forceinline__ void PrefetchL2(const void* p) { __builtin_prefetch(p); }
__device__ __forceinline__ int4 LoadStream(const int4* p) {
  typedef int NativeInt4 __attribute__((ext_vector_type(4)));
  const NativeInt4 v = __builtin_nontemporal_load(reinterpret_cast<const NativeInt4*>(p));
  return make_int4(v.x, v.y, v.z, v.w);
}
__device__ __forceinline__ int4 LoadPeer(const int4* p) { return *p; }
__device__ __forceinline__ void Store16(int4* p, int4 v) { *p = v; }
__device__ __forceinline__ float ShflXorF(float v, int mask) { return __shfl_xor(v, mask); }
__device__ __forceinline__ float ShflIdxF(float v, int src) { return __shfl(v, src); }
// A value another GPU published before a flag we acquired (no stale cache line).
__device__ __forceinline__ int32_t LoadRelaxedSys(const int32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ uint2 LoadPeer8(const uint2* p) { return *p; }
__device__ __forceinline__ float LoadPeerF(const float* p) { return *p; }
__device__ __forceinline__ void Store8(uint2* p, uint2 v) { *p = v; }
#else
constexpr int kWarpSize = 32;
using LaneMask = uint32_t;

__device__ __forceinline__ int LaneId() { return threadIdx.x & 31; }
__device__ __forceinline__ LaneMask Ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
__device__ __forceinline__ int PopCount(LaneMask m) { return __popc(m); }
__device__ __forceinline__ int LowestLane(LaneMask m) { return __ffs(m) - 1; }
__device__ __forceinline__ LaneMask LanesBelow(int lane) { return (1u << lane) - 1u; }
__device__ __forceinline__ uint32_t WarpOr(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int32_t AtomicAddSys(int32_t* p, int32_t v) { return atomicAdd_system(p, v); }
// Adds without returning (fire and forget): a remote arrival count.
__device__ __forceinline__ void RedAddSys(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// ORs without returning (no reply for the thread to wait on): bits this device reads later.
__device__ __forceinline__ void RedOrGpu(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.gpu.global.or.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void FenceSys() { __threadfence_system(); }
__device__ __forceinline__ void SyncWarp() { __syncwarp(); }
// Polling backoff: a tight spin of many threads on one flag floods the L2
// slice that also absorbs the peers' incoming NVLink writes.
__device__ __forceinline__ void Backoff(uint32_t ns) {
  if (ns) __nanosleep(ns);
}
__device__ __forceinline__ int ShflIdx(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ int ShflUp(int v, int d) { return __shfl_up_sync(0xffffffffu, v, d); }
// Starts moving one 128-byte line into L2 without waiting for it.
__device__ __forceinline__ void PrefetchL2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
// Read-only input: non-coherent path, no L1 allocation (streamed once).
__device__ __forceinline__ int4 LoadStream(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// Memory another GPU wrote before a flag we acquired: coherent load, no L1 allocation.
__device__ __forceinline__ int4 LoadPeer(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ void Store16(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ float ShflXorF(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ float ShflIdxF(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
// A value another GPU published before a flag we acquired (no stale cache line).
__device__ __forceinline__ int32_t LoadRelaxedSys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// 8-byte (FP8 row) accesses, same caching as LoadPeer / Store16.
__device__ __forceinline__ uint2 LoadPeer8(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float LoadPeerF(const float* p) {
  float v;
  asm volatile("ld.global.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void Store8(uint2* p, uint2 v) {
  asm volatile("st.global.L1::no_allocate.v2.u32 [%0], {%1,%2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
#endif

// Signed distance of round counters (wrap-safe for uint32 epochs).
__device__ __forceinline__ bool ReachedRound(uint32_t value, uint32_t round) {
  return static_cast<int32_t>(value - round) >= 0;
}

// bf16 <-> f32 by bit manipulation (round to nearest even), so no vendor bf16
// header is needed and both toolchains produce identical results.
__device__ __forceinline__ float Bf16ToFloat(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Element traits of the combine dtypes: a 16-byte vector holds kElems values.
template <typename T>
struct VecTraits;

struct Bf16Tag {};

template <>
struct VecTraits<Bf16Tag> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void Accumulate(float (&acc)[8], const int4& v) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += __uint_as_float(w[i] << 16);
      acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  // acc += w * v, the product rounded on its own (no fused multiply-add), as torch computes it.
  __device__ __forceinline__ static void AccumulateScaled(float (&acc)[8], const int4& v, float w) {
    const uint32_t x[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += __fmul_rn(__uint_as_float(x[i] << 16), w);
      acc[2 * i + 1] += __fmul_rn(__uint_as_float(x[i] & 0xffff0000u), w);
    }
  }
  // The values the packed vector holds (acc rounded to bf16), as floats.
  __device__ __forceinline__ static void Round(float (&acc)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = Bf16ToFloat(FloatToBf16(acc[i]));
  }
  __device__ __forceinline__ static void Unpack(const int4& v, float (&out)[8]) {
    const uint32_t x[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(x[i] << 16);
      out[2 * i + 1] = __uint_as_float(x[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static int4 Pack(const float (&acc)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<uint32_t>(FloatToBf16(acc[2 * i])) | (static_cast<uint32_t>(FloatToBf16(acc[2 * i + 1])) << 16);
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
  }
};

template <>
struct VecTraits<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void Accumulate(float (&acc)[4], const int4& v) {
    acc[0] += __int_as_float(v.x);
    acc[1] += __int_as_float(v.y);
    acc[2] += __int_as_float(v.z);
    acc[3] += __int_as_float(v.w);
  }
  __device__ __forceinline__ static void AccumulateScaled(float (&acc)[4], const int4& v, float w) {
    acc[0] += __fmul_rn(__int_as_float(v.x), w);
    acc[1] += __fmul_rn(__int_as_float(v.y), w);
    acc[2] += __fmul_rn(__int_as_float(v.z), w);
    acc[3] += __fmul_rn(__int_as_float(v.w), w);
  }
  __device__ __forceinline__ static void Round(float (&)[4]) {}
  __device__ __forceinline__ static void Unpack(const int4& v, float (&out)[4]) {
    out[0] = __int_as_float(v.x);
    out[1] = __int_as_float(v.y);
    out[2] = __int_as_float(v.z);
    out[3] = __int_as_float(v.w);
  }
  __device__ __forceinline__ static int4 Pack(const float (&acc)[4]) {
    return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]), __float_as_int(acc[3]));
  }
};

}  // namespace mori::ep::dev
