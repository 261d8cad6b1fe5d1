// Host build of the kernels' FP8 codec (mori_core/csrc/ops/fp8_codec.hpp), driven by
// tests/ep/test_fp8_codec.py:  fp8_codec_check IN.f32 OUT.u8 DECODED.f32
// encodes every float of IN, and decodes all 256 byte values.
#include <cstdio>
#include <vector>

#include "ops/fp8_codec.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s IN.f32 OUT.u8 DECODED.f32\n", argv[0]);
    return 2;
  }
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 3;
  std::vector<float> xs;
  float f;
  while (std::fread(&f, sizeof(f), 1, in) == 1) xs.push_back(f);
  std::fclose(in);
  std::vector<unsigned char> enc(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) enc[i] = mori::ep::fp8::EncodeE4m3(xs[i]);
  std::FILE* out = std::fopen(argv[2], "wb");
  if (!out || std::fwrite(enc.data(), 1, enc.size(), out) != enc.size()) return 4;
  std::fclose(out);
  float dec[256];
  for (int b = 0; b < 256; ++b) dec[b] = mori::ep::fp8::DecodeE4m3(static_cast<unsigned char>(b));
  std::FILE* d = std::fopen(argv[3], "wb");
  if (!d || std::fwrite(dec, sizeof(float), 256, d) != 256) return 5;
  std::fclose(d);
  return 0;
}
