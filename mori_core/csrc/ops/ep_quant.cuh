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

// max that keeps NaN (like torch.amax), so a NaN block scales exactly as the reference does.
__device__ __forceinline__ float NanMax(float a, float b) { return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b); }

__device__ __forceinline__ const float* Fp8RowScales(const uint8_t* row, int row_bytes) {
  return reinterpret_cast<const float*>(row + row_bytes / 2);
}

// Quantises the 8 values of vector v and stores them (and the block scale) into `row`.
// Every lane of the warp must call it together (blockwise: a 16-lane max); lanes whose
// vector is past the row pass active = false. Vector indices must be 16-aligned per
// 16-lane group (the callers' row splits are multiples of 16 vectors).
template <int kQuant>
__device__ __forceinline__ void Fp8QuantStore(const float (&f)[8], bool active, uint8_t* row, int row_bytes, int v) {
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
  if (!active) return;
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float a = kQuant == kQuantFp8Block ? f[j] * inv : f[j];
    const float b = kQuant == kQuantFp8Block ? f[j + 4] * inv : f[j + 4];
    lo |= static_cast<uint32_t>(fp8::EncodeE4m3(a)) << (8 * j);
    hi |= static_cast<uint32_t>(fp8::EncodeE4m3(b)) << (8 * j);
  }
  Store8(reinterpret_cast<uint2*>(row) + v, make_uint2(lo, hi));
  if (kQuant == kQuantFp8Block && (v % kFp8BlockVecs) == 0)
    reinterpret_cast<float*>(row + row_bytes / 2)[v / kFp8BlockVecs] = scale;
}

// acc += dequantised 8 values of an e4m3 vector (blockwise: times the block scale).
template <int kQuant>
__device__ __forceinline__ void Fp8Accumulate(float (&acc)[8], uint32_t lo, uint32_t hi, float scale) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float a = fp8::DecodeE4m3(static_cast<uint8_t>(lo >> (8 * j)));
    const float b = fp8::DecodeE4m3(static_cast<uint8_t>(hi >> (8 * j)));
    acc[j] += kQuant == kQuantFp8Block ? __fmul_rn(a, scale) : a;
    acc[j + 4] += kQuant == kQuantFp8Block ? __fmul_rn(b, scale) : b;
  }
}

}  // namespace mori::ep::dev
