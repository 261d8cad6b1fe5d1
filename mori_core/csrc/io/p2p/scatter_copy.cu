#include <algorithm>
#include <vector>

#include "io/p2p/scatter_copy.hpp"

#if defined(MORI_GPU_HIP)
#define MORI_GRID_CONSTANT
#else
#define MORI_GRID_CONSTANT __grid_constant__
#endif

namespace mori::io::p2p {
namespace {

// Segments travel as a by-value kernel argument: no descriptor upload and no
// buffer whose lifetime must be tracked. Argument bytes are copied at every
// launch, so small batches use a small argument block. CUDA 12.1+ allows
// 32 KiB of arguments; HIP keeps to the classic 4 KiB.
constexpr int kSmallBatch = 64;
#if defined(MORI_GPU_HIP)
constexpr int kLargeBatch = 160;
#else
constexpr int kLargeBatch = 1280;
#endif
constexpr int kThreads = 256;  // one 16 KiB piece = 4 x 16-byte vectors per thread

template <int N>
struct ScatterArgs {
  uint32_t count;
  CopySeg segs[N];
};

template <int N>
__global__ void __launch_bounds__(kThreads) ScatterCopyKernel(const MORI_GRID_CONSTANT ScatterArgs<N> args) {
  for (uint32_t i = blockIdx.x; i < args.count; i += gridDim.x) {
    const CopySeg s = args.segs[i];
    const auto* src = reinterpret_cast<const uint8_t*>(s.src);
    auto* dst = reinterpret_cast<uint8_t*>(s.dst);
    const uint64_t n = s.size;
    uint64_t done = 0;
    if (((s.src | s.dst) & 15) == 0) {
      // 16-byte vectors, four loads in flight per thread before the stores.
      const uint64_t vecs = n / 16;
      const auto* vs = reinterpret_cast<const uint4*>(src);
      auto* vd = reinterpret_cast<uint4*>(dst);
      uint64_t v = threadIdx.x;
      for (; v + 3 * kThreads < vecs; v += 4 * kThreads) {
        uint4 a = vs[v], b = vs[v + kThreads], c = vs[v + 2 * kThreads], d = vs[v + 3 * kThreads];
        vd[v] = a;
        vd[v + kThreads] = b;
        vd[v + 2 * kThreads] = c;
        vd[v + 3 * kThreads] = d;
      }
      for (; v < vecs; v += kThreads) vd[v] = vs[v];
      done = vecs * 16;
    }
    for (uint64_t b = done + threadIdx.x; b < n; b += kThreads) dst[b] = src[b];
  }
}

template <int N>
void Launch(const CopySeg* pieces, uint32_t n, gpuStream_t stream) {
  static thread_local ScatterArgs<N> args;  // up to ~30 KiB: keep it off the stack
  args.count = n;
  std::copy(pieces, pieces + n, args.segs);
  ScatterCopyKernel<N><<<n, kThreads, 0, stream>>>(args);
  MORI_GPU_CHECK(gpuGetLastError());
}

}  // namespace

void LaunchScatterCopy(const CopySeg* segs, size_t count, gpuStream_t stream) {
  // Cut large segments so one block copies at most kScatterPieceBytes.
  static thread_local std::vector<CopySeg> pieces;
  pieces.clear();
  for (size_t i = 0; i < count; ++i)
    for (uint64_t off = 0; off < segs[i].size; off += kScatterPieceBytes)
      pieces.push_back({segs[i].src + off, segs[i].dst + off, std::min(kScatterPieceBytes, segs[i].size - off)});
  for (size_t first = 0; first < pieces.size();) {
    size_t left = pieces.size() - first;
    if (left <= static_cast<size_t>(kSmallBatch)) {
      Launch<kSmallBatch>(pieces.data() + first, static_cast<uint32_t>(left), stream);
      first += left;
    } else {
      uint32_t n = static_cast<uint32_t>(std::min<size_t>(kLargeBatch, left));
      Launch<kLargeBatch>(pieces.data() + first, n, stream);
      first += n;
    }
  }
}

}  // namespace mori::io::p2p
