#include <algorithm>
#include <string>

#include "common/error.hpp"
#include "io/p2p/scatter_copy.hpp"

#if defined(MORI_GPU_HIP)
#define MORI_GRID_CONSTANT
#else
#define MORI_GRID_CONSTANT __grid_constant__
#endif

namespace mori::io::p2p {
namespace {

// Parameter blocks of three sizes: a single transfer should not pay for
// copying 28 KiB of arguments at launch. CUDA 12.1+ allows 32 KiB of kernel
// arguments; HIP keeps to the classic 4 KiB.
constexpr int kTinyBatch = 4;
constexpr int kSmallBatch = 64;
#if defined(MORI_GPU_HIP)
constexpr int kLargeBatch = 128;
#else
constexpr int kLargeBatch = 1024;
#endif
constexpr int kMaxThreads = 1024;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread before its stores

template <int N>
struct ScatterArgs {
  uint32_t count;        // segments
  uint32_t pieceShift;   // log2(piece bytes)
  uint32_t pieces;       // total pieces (= blocks' work items)
  uint32_t value;        // signal value
  uint32_t* counter;
  uint32_t* flag;
  uint32_t firstPiece[N];  // index of each segment's first piece (ascending)
  CopySeg segs[N];
};

__device__ __forceinline__ void CopyPiece(const uint8_t* src, uint8_t* dst, uint64_t n) {
  const uint32_t t = blockDim.x;
  uint64_t done = 0;
  if (((reinterpret_cast<uint64_t>(src) | reinterpret_cast<uint64_t>(dst)) & 15) == 0) {
    const uint64_t vecs = n / 16;
    const auto* vs = reinterpret_cast<const uint4*>(src);
    auto* vd = reinterpret_cast<uint4*>(dst);
    for (uint64_t base = threadIdx.x; base < vecs; base += kUnroll * t) {
      uint4 r[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        if (base + k * t < vecs) r[k] = vs[base + k * t];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        if (base + k * t < vecs) vd[base + k * t] = r[k];
    }
    done = vecs * 16;
  }
  for (uint64_t b = done + threadIdx.x; b < n; b += t) dst[b] = src[b];
}

template <int N>
__global__ void __launch_bounds__(kMaxThreads) ScatterCopyKernel(const MORI_GRID_CONSTANT ScatterArgs<N> a) {
  for (uint32_t p = blockIdx.x; p < a.pieces; p += gridDim.x) {
    // The segment holding piece p: the last one whose first piece is <= p.
    uint32_t lo = 0, hi = a.count - 1;
    while (lo < hi) {
      const uint32_t mid = (lo + hi + 1) >> 1;
      if (a.firstPiece[mid] <= p)
        lo = mid;
      else
        hi = mid - 1;
    }
    const CopySeg s = a.segs[lo];
    const uint64_t off = static_cast<uint64_t>(p - a.firstPiece[lo]) << a.pieceShift;
    const uint64_t n = min(static_cast<uint64_t>(1) << a.pieceShift, s.size - off);
    CopyPiece(reinterpret_cast<const uint8_t*>(s.src) + off, reinterpret_cast<uint8_t*>(s.dst) + off, n);
  }
  if (a.flag == nullptr) return;
  // Completion signal. Every thread orders its own stores (to peer memory over
  // NVLink, or local) before the barrier; the block's arrival is counted; the
  // last block to arrive resets the counter for the slot's next use and
  // publishes the value to the host.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t prev = atomicAdd(a.counter, 1u);
    if (prev == gridDim.x - 1) {
      __threadfence_system();
      *a.counter = 0;
      __threadfence();  // the reset is visible on the device before the host may reuse the slot
      *reinterpret_cast<volatile uint32_t*>(a.flag) = a.value;
    }
  }
}

template <int N>
void Launch(const CopySeg* segs, uint32_t n, uint32_t shift, uint32_t threads, const KernelSignal& sig,
            gpuStream_t stream) {
  static thread_local ScatterArgs<N> args;  // up to ~28 KiB: keep it off the stack
  uint64_t pieces = 0;
  for (uint32_t i = 0; i < n; ++i) {
    args.firstPiece[i] = static_cast<uint32_t>(pieces);
    args.segs[i] = segs[i];
    pieces += (segs[i].size + (1ull << shift) - 1) >> shift;
  }
  args.count = n;
  args.pieceShift = shift;
  args.pieces = static_cast<uint32_t>(pieces);
  args.value = sig.value;
  args.counter = sig.counter;
  args.flag = sig.flag;
  if (pieces == 0) return;
  ScatterCopyKernel<N><<<static_cast<uint32_t>(pieces), threads, 0, stream>>>(args);
  MORI_GPU_CHECK(gpuGetLastError());
}

uint32_t Log2(uint32_t v) {
  uint32_t s = 0;
  while ((1u << s) < v) ++s;
  return s;
}

}  // namespace

size_t MaxSegmentsPerLaunch() { return kLargeBatch; }

void LaunchScatterCopy(const CopySeg* segs, size_t count, const ScatterShape& shape, const KernelSignal& signal,
                       gpuStream_t stream) {
  const uint32_t shift = Log2(shape.pieceBytes);
  if ((1u << shift) != shape.pieceBytes || shift < 12 || shift > 20)
    throw InvalidArgument("scatter copy: piece size " + std::to_string(shape.pieceBytes) +
                          " must be a power of two in [4096, 1048576]");
  if (shape.threads < 64 || shape.threads > kMaxThreads || shape.threads % 32 != 0)
    throw InvalidArgument("scatter copy: " + std::to_string(shape.threads) +
                          " threads per block must be a multiple of 32 in [64, 1024]");
  // One launch's pieces must fit the grid (2^31 - 1 blocks): cut where needed.
  constexpr uint64_t kMaxPieces = 1ull << 30;
  size_t first = 0;
  while (first < count) {
    size_t n = 0;
    uint64_t pieces = 0;
    while (first + n < count && n < static_cast<size_t>(kLargeBatch)) {
      uint64_t p = (segs[first + n].size + shape.pieceBytes - 1) >> shift;
      if (n > 0 && pieces + p > kMaxPieces) break;
      pieces += p;
      ++n;
    }
    if (pieces > kMaxPieces)
      throw InvalidArgument("scatter copy: a segment of " + std::to_string(segs[first].size) +
                            " bytes is too large for one launch");
    const bool last = first + n == count;
    const KernelSignal sig = last ? signal : KernelSignal{};
    const auto u = static_cast<uint32_t>(n);
    if (n <= static_cast<size_t>(kTinyBatch))
      Launch<kTinyBatch>(segs + first, u, shift, shape.threads, sig, stream);
    else if (n <= static_cast<size_t>(kSmallBatch))
      Launch<kSmallBatch>(segs + first, u, shift, shape.threads, sig, stream);
    else
      Launch<kLargeBatch>(segs + first, u, shift, shape.threads, sig, stream);
    first += n;
  }
}

}  // namespace mori::io::p2p
