// FP8 transport of combine rows (quant_type fp8_direct_cast / fp8_blockwise): one warp
// quantises 16-byte vectors of 8 bf16 values into 8-byte e4m3 vectors on the sending
// side, and the receiving side dequantises them into its fp32 accumulators.
//
// Row layout of a quantised row inside a slot of `row_bytes` (= 2 * hidden) bytes:
//   [hidden e4m3 bytes][hidden / 128 fp32 scales (fp8_blockwise only)]
// Blockwise: scale = amax / 448 of the 128-channel block (1 when the block is all zero),
// q = e4m3(x * (1 / scale)); the receiver adds q * scale. Every product is rounded on its
// own (no fused multiply-add) so the reference op reproduces the bytes and sums exactly.
#pragma once

#include "ops/device_primitives.hpp"
#include "ops/ep_types.hpp"
#include "ops/fp8_codec.hpp"

namespace mori::ep::dev {

constexpr int kFp8BlockVecs = kFp8BlockElems / 8;  // 16-byte bf16 vectors per scale block

// NVIDIA sm_89 and newer convert two values per instruction (cvt ... e4m3x2), with the same
// rounding (nearest, ties to even, subnormals included) and saturation (satfinite: |x| >= 448 and
// +-inf give +-448) as fp8::EncodeE4m3. The software codec costs ~10 integer operations per value
// to encode and ~6 to decode; across the 100 M values a rank converts in an EP4 x 4096 combine
// those issue slots were what the push and reduce loops lacked for their loads (4xH100, same run:
// direct cast 378 -> 310 us, blockwise 437 -> 354 us; docs/ep.md, issue #31 round 6).
// Elsewhere (HIP, older NVIDIA), or built with MORI_EP_FP8_SOFT_CODEC defined (for A/B runs),
// the software codec runs. Both give the bytes torch's
// float8_e4m3fn cast gives (tests/ep/test_fp8_codec.py host side, the GPU suite's codec case
// device side); only the sign of a NaN may differ (the hardware writes 0x7f).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(MORI_EP_FP8_SOFT_CODEC)
#define MORI_EP_FP8_CVT_X2 1
#else
#define MORI_EP_FP8_CVT_X2 0
#endif

// e4m3 bytes of a (low byte) and b (high byte).
__device__ __forceinline__ uint32_t EncodeE4m3x2(float a, float b) {
#if MORI_EP_FP8_CVT_X2
  uint16_t d;
  // the first source goes to the upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(b), "f"(a));
  return d;
#else
  return static_cast<uint32_t>(fp8::EncodeE4m3(a)) | (static_cast<uint32_t>(fp8::EncodeE4m3(b)) << 8);
#endif
}

// The values of the two e4m3 bytes in the low 16 bits of `two` (low byte first).
__device__ __forceinline__ void DecodeE4m3x2(uint32_t two, float& lo, float& hi) {
#if MORI_EP_FP8_CVT_X2
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(two)));
  // every e4m3 value is exact in fp16 and so in fp32
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(static_cast<uint16_t>(h2)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(static_cast<uint16_t>(h2 >> 16)));
#else
  lo = fp8::DecodeE4m3(static_cast<uint8_t>(two));
  hi = fp8::DecodeE4m3(static_cast<uint8_t>(two >> 8));
#endif
}

// max that keeps NaN (like torch.amax), so a NaN block scales exactly as the reference does.
// sm_80 and newer have it as one instruction (max.NaN gives the canonical NaN, as the fallback).
__device__ __forceinline__ float NanMax(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
#endif
}

__device__ __forceinline__ const float* Fp8RowScales(const uint8_t* row, int row_bytes) {
  return reinterpret_cast<const float*>(row + row_bytes / 2);
}

// Quantises the 8 values of vector v and stores them into `row`; returns the block scale
// (blockwise; 1 for direct cast), which the caller stores with Fp8StoreScales. Every lane of the
// warp must call it together (blockwise: a 16-lane max); lanes whose vector is past the row pass
// active = false. Vector indices must be 16-aligned per 16-lane group (the callers' row splits
// are multiples of 16 vectors).
template <int kQuant>
__device__ __forceinline__ float Fp8QuantStore(const float (&f)[8], bool active, uint8_t* row, int row_bytes, int v) {
  float scale = 1.f, inv = 1.f;
  if (kQuant == kQuantFp8Block) {
    float m = 0.f;
    if (active) {
#pragma unroll
      for (int j = 0; j < 8; ++j) m = NanMax(m, fabsf(f[j]));
    }
#pragma unroll
    for (int o = kFp8BlockVecs / 2; o > 0; o >>= 1) m = NanMax(m, ShflXorF(m, o));
    scale = m > 0.f ? m / fp8::kE4m3Max : 1.f;
    inv = 1.f / scale;
  }
  if (!active) return scale;
  float g[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) g[j] = kQuant == kQuantFp8Block ? f[j] * inv : f[j];
  const uint32_t lo = EncodeE4m3x2(g[0], g[1]) | (EncodeE4m3x2(g[2], g[3]) << 16);
  const uint32_t hi = EncodeE4m3x2(g[4], g[5]) | (EncodeE4m3x2(g[6], g[7]) << 16);
  Store8(reinterpret_cast<uint2*>(row) + v, make_uint2(lo, hi));
  return scale;
}

// Stores the block scales of one pass of a warp over vectors [v0, v0 + kWarpSize * kU) of a row
// (v0 16-aligned; sc[u] = Fp8QuantStore's return for the lane's vector v0 + lane + u * kWarpSize;
// blocks at or past v1 are skipped) with one store: lane j writes block j's scale. One store per
// block (the first lane of each 16) put a 4-byte write beside every 128 bytes of e4m3 values, and
// the rows are mostly written into a peer's memory, where each write is a packet of its own.
template <int kQuant, int kU>
__device__ __forceinline__ void Fp8StoreScales(const float (&sc)[kU], uint8_t* row, int row_bytes, int v0, int v1,
                                               int lane) {
  if constexpr (kQuant == kQuantFp8Block) {
    constexpr int kGroups = kWarpSize / kFp8BlockVecs;  // blocks per vector index u of a pass
    static_assert(kGroups * kU <= kWarpSize, "one lane per block of a pass");
    float mine = 0.f;
#pragma unroll
    for (int u = 0; u < kU; ++u) {  // block j = u * kGroups + h sits in lane h * 16 of sc[u]
      const float s = ShflIdxF(sc[u], (lane % kGroups) * kFp8BlockVecs);
      if (lane / kGroups == u) mine = s;
    }
    if (lane < kGroups * kU && v0 + lane * kFp8BlockVecs < v1)
      reinterpret_cast<float*>(row + row_bytes / 2)[v0 / kFp8BlockVecs + lane] = mine;
  }
}

// acc += dequantised 8 values of an e4m3 vector (blockwise: times the block scale).
template <int kQuant>
__device__ __forceinline__ void Fp8Accumulate(float (&acc)[8], uint32_t lo, uint32_t hi, float scale) {
  float d[8];
  DecodeE4m3x2(lo, d[0], d[1]);
  DecodeE4m3x2(lo >> 16, d[2], d[3]);
  DecodeE4m3x2(hi, d[4], d[5]);
  DecodeE4m3x2(hi >> 16, d[6], d[7]);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] += kQuant == kQuantFp8Block ? __fmul_rn(d[j], scale) : d[j];
}

}  // namespace mori::ep::dev
