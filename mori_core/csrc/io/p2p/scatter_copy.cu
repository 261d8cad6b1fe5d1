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

// Parameter blocks of two sizes: a single transfer should not pay for copying
// 1.8 KiB of arguments at launch. Both fit HIP's 4 KiB.
constexpr int kTinyBatch = 4;
constexpr int kSmallBatch = static_cast<int>(kParamSegments);
constexpr int kMaxThreads = 1024;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread before its stores
constexpr uint64_t kMaxPieces = 0xffffffffull;  // piece indices are 32-bit
constexpr uint32_t kMaxGrid = 65536;

template <int N>
struct ScatterArgs {
  uint32_t count;        // segments
  uint32_t pieceShift;   // log2(piece bytes)
  uint32_t pieces;       // total pieces
  uint32_t value;        // signal value
  uint32_t* counter;
  uint32_t* flag;
  uint32_t firstPiece[N];  // index of each segment's first piece (ascending)
  CopySeg segs[N];
};

struct TableArgs {
  const SegmentTable::Entry* entries;  // device memory
  uint32_t count;
  uint32_t pieceShift;
  uint32_t pieces;
  uint32_t value;
  uint32_t* counter;
  uint32_t* flag;
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

// This block's run of pieces, [first, end): consecutive, so the segment lookup
// is one binary search per block and a forward walk after it. Grids of one
// block per piece get one piece each (the search is then per piece).
// `firstOf(i)` / `segOf(i)`: segment i's first piece and descriptor.
template <class FirstOf, class SegOf>
__device__ __forceinline__ void CopyBlockPieces(uint32_t count, uint32_t shift, uint32_t pieces, FirstOf firstOf,
                                                SegOf segOf) {
  const uint32_t p0 = static_cast<uint32_t>(static_cast<uint64_t>(blockIdx.x) * pieces / gridDim.x);
  const uint32_t end = static_cast<uint32_t>(static_cast<uint64_t>(blockIdx.x + 1) * pieces / gridDim.x);
  if (p0 >= end) return;
  uint32_t lo = 0, hi = count - 1;  // the last segment whose first piece is <= p0
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) >> 1;
    if (firstOf(mid) <= p0)
      lo = mid;
    else
      hi = mid - 1;
  }
  uint32_t seg = lo;
  uint32_t segFirst = firstOf(seg);
  uint32_t nextFirst = seg + 1 < count ? firstOf(seg + 1) : pieces;
  CopySeg s = segOf(seg);
  for (uint32_t p = p0; p < end; ++p) {
    while (p >= nextFirst) {  // empty segments have no pieces: skip them too
      ++seg;
      segFirst = nextFirst;
      nextFirst = seg + 1 < count ? firstOf(seg + 1) : pieces;
      s = segOf(seg);
    }
    const uint64_t off = static_cast<uint64_t>(p - segFirst) << shift;
    const uint64_t n = min(static_cast<uint64_t>(1) << shift, s.size - off);
    CopyPiece(reinterpret_cast<const uint8_t*>(s.src) + off, reinterpret_cast<uint8_t*>(s.dst) + off, n);
  }
}

// Completion signal. Every thread orders its own stores (to peer memory over
// NVLink, or local) before the barrier; the block's arrival is counted; the
// last block to arrive resets the counter for the slot's next use and
// publishes the value to the host.
__device__ __forceinline__ void SignalDone(uint32_t* counter, uint32_t* flag, uint32_t value) {
  if (flag == nullptr) return;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t prev = atomicAdd(counter, 1u);
    if (prev == gridDim.x - 1) {
      __threadfence_system();
      *counter = 0;
      __threadfence();  // the reset is visible on the device before the host may reuse the slot
      *reinterpret_cast<volatile uint32_t*>(flag) = value;
    }
  }
}

template <int N>
__global__ void __launch_bounds__(kMaxThreads) ScatterCopyKernel(const MORI_GRID_CONSTANT ScatterArgs<N> a) {
  CopyBlockPieces(
      a.count, a.pieceShift, a.pieces, [&](uint32_t i) { return a.firstPiece[i]; },
      [&](uint32_t i) { return a.segs[i]; });
  SignalDone(a.counter, a.flag, a.value);
}

__global__ void __launch_bounds__(kMaxThreads) ScatterCopyTableKernel(const TableArgs a) {
  const SegmentTable::Entry* e = a.entries;
  CopyBlockPieces(
      a.count, a.pieceShift, a.pieces, [&](uint32_t i) { return e[i].firstPiece; },
      [&](uint32_t i) { return CopySeg{e[i].src, e[i].dst, e[i].size}; });
  SignalDone(a.counter, a.flag, a.value);
}

uint32_t Log2(uint32_t v) {
  uint32_t s = 0;
  while ((1u << s) < v) ++s;
  return s;
}

uint32_t GridFor(uint64_t pieces, const ScatterShape& shape) {
  const uint64_t cap = shape.maxBlocks ? shape.maxBlocks : 0x7fffffffull;  // CUDA's grid limit
  return static_cast<uint32_t>(std::min<uint64_t>(pieces, cap));
}

uint64_t PiecesOf(uint64_t size, uint32_t shift) { return (size + (1ull << shift) - 1) >> shift; }

template <int N>
void LaunchParams(const CopySeg* segs, uint32_t n, uint32_t shift, const ScatterShape& shape, const KernelSignal& sig,
                  gpuStream_t stream) {
  static thread_local ScatterArgs<N> args;  // up to 1.8 KiB: keep it off the stack
  uint64_t pieces = 0;
  for (uint32_t i = 0; i < n; ++i) {
    args.firstPiece[i] = static_cast<uint32_t>(pieces);
    args.segs[i] = segs[i];
    pieces += PiecesOf(segs[i].size, shift);
  }
  if (pieces > kMaxPieces)
    throw InvalidArgument("scatter copy: " + std::to_string(pieces) + " pieces exceed one launch's " +
                          std::to_string(kMaxPieces));
  args.count = n;
  args.pieceShift = shift;
  args.pieces = static_cast<uint32_t>(pieces);
  args.value = sig.value;
  args.counter = sig.counter;
  args.flag = sig.flag;
  if (pieces == 0) return;
  ScatterCopyKernel<N><<<GridFor(pieces, shape), shape.threads, 0, stream>>>(args);
  MORI_GPU_CHECK(gpuGetLastError());
}

}  // namespace

void CheckScatterShape(const ScatterShape& shape) {
  const uint32_t shift = Log2(shape.pieceBytes);
  if ((1u << shift) != shape.pieceBytes || shift < 12 || shift > 20)
    throw InvalidArgument("scatter copy: piece size " + std::to_string(shape.pieceBytes) +
                          " must be a power of two in [4096, 1048576]");
  if (shape.threads < 64 || shape.threads > kMaxThreads || shape.threads % 32 != 0)
    throw InvalidArgument("scatter copy: " + std::to_string(shape.threads) +
                          " threads per block must be a multiple of 32 in [64, 1024]");
  if (shape.maxBlocks > kMaxGrid)
    throw InvalidArgument("scatter copy: max blocks " + std::to_string(shape.maxBlocks) + " must be in [0, " +
                          std::to_string(kMaxGrid) + "]");
}

void LaunchScatterCopy(const CopySeg* segs, size_t count, const ScatterShape& shape, const KernelSignal& signal,
                       gpuStream_t stream) {
  CheckScatterShape(shape);
  if (count > kParamSegments)
    throw InvalidArgument("scatter copy: " + std::to_string(count) + " segments need a segment table (at most " +
                          std::to_string(kParamSegments) + " travel as parameters)");
  const uint32_t shift = Log2(shape.pieceBytes);
  const auto n = static_cast<uint32_t>(count);
  if (count <= static_cast<size_t>(kTinyBatch))
    LaunchParams<kTinyBatch>(segs, n, shift, shape, signal, stream);
  else
    LaunchParams<kSmallBatch>(segs, n, shift, shape, signal, stream);
}

void LaunchScatterTable(SegmentTable& table, size_t count, const ScatterShape& shape, const KernelSignal& signal,
                        gpuStream_t stream) {
  CheckScatterShape(shape);
  if (count > table.capacity())
    throw InvalidArgument("scatter copy: " + std::to_string(count) + " segments exceed the table's " +
                          std::to_string(table.capacity()));
  if (count == 0) return;
  const uint32_t shift = Log2(shape.pieceBytes);
  SegmentTable::Entry* e = table.host();
  uint64_t pieces = 0;
  for (size_t i = 0; i < count; ++i) {
    e[i].firstPiece = static_cast<uint32_t>(pieces);
    pieces += PiecesOf(e[i].size, shift);
    if (pieces > kMaxPieces)
      throw InvalidArgument("scatter copy: more than " + std::to_string(kMaxPieces) +
                            " pieces in one launch (use a larger piece size)");
  }
  if (pieces == 0) return;
  MORI_GPU_CHECK(gpuMemcpyAsync(const_cast<SegmentTable::Entry*>(table.device()), e,
                                count * sizeof(SegmentTable::Entry), gpuMemcpyHostToDevice, stream));
  TableArgs args{table.device(), static_cast<uint32_t>(count), shift, static_cast<uint32_t>(pieces),
                 signal.value, signal.counter, signal.flag};
  ScatterCopyTableKernel<<<GridFor(pieces, shape), shape.threads, 0, stream>>>(args);
  MORI_GPU_CHECK(gpuGetLastError());
}

// ------------------------------------------------------------- SegmentTable
SegmentTable::SegmentTable(int device, size_t capacity) : deviceId_(device), capacity_(capacity) {
  void* host = nullptr;
  MORI_GPU_CHECK(gpuHostAlloc(&host, capacity * sizeof(Entry), gpuHostAllocPortable));
  void* dev = nullptr;
  gpuError_t e = gpuMalloc(&dev, capacity * sizeof(Entry));
  if (e != gpuSuccess) {
    (void)gpuFreeHost(host);
    MORI_GPU_CHECK(e);
  }
  host_ = static_cast<Entry*>(host);
  device_ = static_cast<Entry*>(dev);
}

SegmentTable::~SegmentTable() {
  DeviceGuard g(deviceId_);
  (void)gpuFree(device_);
  (void)gpuFreeHost(host_);
}

std::unique_ptr<SegmentTable> SegmentTablePool::Acquire(size_t count) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i]->capacity() >= count) {
        std::unique_ptr<SegmentTable> t = std::move(free_[i]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        return t;
      }
    }
  }
  size_t cap = 4096;  // 128 KiB: a 2,048-token request's pages, per-layer K and V, fit a few of these
  while (cap < count) cap *= 2;
  return std::make_unique<SegmentTable>(device_, cap);
}

void SegmentTablePool::Release(std::unique_ptr<SegmentTable> t) {
  if (!t) return;
  std::unique_ptr<SegmentTable> drop;  // freed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < kKeep)
    free_.push_back(std::move(t));
  else
    drop = std::move(t);
}

}  // namespace mori::io::p2p
