// FP8 e4m3 (OCP "e4m3fn": bias 7, no infinities, 0x7f = NaN, max 448) encode/decode
// by bit manipulation, usable on the host and on both GPU vendors, so the combine
// kernels, the host-side check (tests/ep/fp8_codec_check.cpp) and torch's
// float8_e4m3fn cast give identical bytes.
//
// Encoding saturates: |x| >= 448 (and +-inf) becomes +-448, NaN stays NaN; everything
// else rounds to nearest, ties to even, including the subnormal range (steps of 2^-9).
// That equals torch's `x.clamp(-448, 448).to(torch.float8_e4m3fn)`.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MORI_FP8_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define MORI_FP8_HD inline
#endif

namespace mori::ep::fp8 {

constexpr float kE4m3Max = 448.0f;

MORI_FP8_HD uint32_t BitsOf(float f) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

MORI_FP8_HD float FloatOf(uint32_t u) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

MORI_FP8_HD float RoundToInt(float v) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return rintf(v);
#else
  return std::nearbyint(v);  // default rounding mode: to nearest, ties to even
#endif
}

MORI_FP8_HD uint8_t EncodeE4m3(float f) {
  const uint32_t u = BitsOf(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;   // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // |f| >= 448: saturate
  if (a < 0x3c800000u) {                     // |f| < 2^-6: multiples of 2^-9 (8 = smallest normal)
    return sign | static_cast<uint8_t>(RoundToInt(FloatOf(a) * 512.0f));
  }
  a += 0x7ffffu + ((a >> 20) & 1u);  // keep 3 mantissa bits, nearest-even (carries into the exponent)
  return sign | static_cast<uint8_t>((a >> 20) - ((127u - 7u) << 3));
}

MORI_FP8_HD float DecodeE4m3(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t em = b & 0x7fu;
  if (em == 0x7fu) return FloatOf(sign | 0x7fc00000u);
  if (em < 8u) return FloatOf(sign | BitsOf(static_cast<float>(em) * (1.0f / 512.0f)));
  return FloatOf(sign | ((em + ((127u - 7u) << 3)) << 20));
}

}  // namespace mori::ep::fp8
