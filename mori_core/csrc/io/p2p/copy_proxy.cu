#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "common/error.hpp"
#include "common/logging.hpp"
#include "io/p2p/copy_proxy.hpp"
#include "ops/device_primitives.hpp"

namespace mori::io::p2p {

// One posted transfer, in pinned host memory. Every 8-byte word carries its
// own tag (the entry's sequence number) beside 32 bits of data, and aligned
// 8-byte stores and reads are atomic: a word read with the right tag is the
// new value, so the GPU needs no separate "ready" flag, no ordering between
// the host's stores, and reads a whole entry in one PCIe round trip (NCCL's
// LL protocol makes the same use of 8-byte atomicity).
//   word 0 count, 1 pieces (4 KiB) over all segments, 2 signal value,
//   3/4 signal word pointer (low/high), then per segment:
//   src low/high, dst low/high, size, first piece.
constexpr uint32_t kHeaderWords = 5, kSegWords = 6;
constexpr uint32_t kEntryWords = kHeaderWords + kSegWords * CopyProxy::kMaxSegments;
struct ProxyEntry {
  uint64_t w[kEntryWords];
};

// Pinned host memory, written by both sides.
struct ProxyControl {
  uint32_t state;  // 1: a grid is resident (or about to be), 0: none / leaving
  uint32_t consumed;  // entries the leader has read; the host reuses ring slots behind it
  uint32_t quit;   // set by the host at teardown: leave as soon as idle
  uint32_t pad;
};

// Device memory; outlives grids.
struct ProxyDeviceState {
  uint32_t tail;       // entries consumed when the last grid left (where the next starts)
  uint32_t posted;     // entries the leader has copied into `mailbox` for the other blocks
  uint32_t stopEpoch;  // the grid (by epoch) that is leaving ...
  uint32_t stopAt;     // ... after this many entries
  uint32_t arrive[CopyProxy::kRing];  // blocks done with each ring slot's entry
  uint32_t progress[CopyProxy::kMaxBlocks + 1];  // entries each block has finished (bounds mailbox reuse)
  // The leader's decoded copy of each ring entry: one reader of host memory
  // (many SMs reading the same host words contend on PCIe), the others read here.
  uint32_t mailbox[CopyProxy::kRing][kEntryWords];
};

namespace {

namespace dev = mori::ep::dev;

constexpr uint32_t kPieceShift = 12;  // one warp copies one 4 KiB piece per step
constexpr uint32_t kCmdEntry = 1, kCmdExit = 2;
constexpr uint32_t kQuitPollEvery = 16;  // ring poll pairs per look at ctl.quit (each poll is a PCIe read)
constexpr uint32_t kPollStaggerNs = 500;
// Entries of at most this many pieces (16 KiB) the leader warp copies itself:
// handing them to a copy block costs more (a wake-up and a mailbox read) than
// the copy.
constexpr uint32_t kLeaderPieces = 4;  // about half a GPU->host read round trip
constexpr uint32_t kWarp = 32;
static_assert(kHeaderWords + kSegWords * kLeaderPieces <= kWarp, "a leader-copied entry must fit one warp read");

struct ProxyArgs {
  ProxyEntry* ring;
  ProxyControl* ctl;
  ProxyDeviceState* st;
  uint32_t epoch;
  uint64_t idleNs;
};

__device__ __forceinline__ uint64_t LoadWord(const uint64_t* p) { return *reinterpret_cast<const volatile uint64_t*>(p); }

// A warp copies up to 4 KiB: one round of 16-byte loads (8 per lane), then the stores.
__device__ __forceinline__ void CopyPieceWarp(const uint8_t* src, uint8_t* dst, uint32_t n, uint32_t lane) {
  uint32_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    constexpr int kPerLane = (1 << kPieceShift) / 16 / 32;
    const uint32_t vecs = n / 16;
    const auto* vs = reinterpret_cast<const uint4*>(src);
    auto* vd = reinterpret_cast<uint4*>(dst);
    uint4 r[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      if (lane + k * 32 < vecs) r[k] = vs[lane + k * 32];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      if (lane + k * 32 < vecs) vd[lane + k * 32] = r[k];
    done = vecs * 16;
  }
  for (uint32_t b = done + lane; b < n; b += 32) dst[b] = src[b];
}

// Takes entry `next` if it is complete. `v` is this lane's read of word
// `lane` (the warp's read of words [0, 32)); when they hold the header and
// more segments follow, the rest is read here. Returns true (and leaves the
// data in the mailbox) once every word it needs is tagged.
__device__ bool TakeEntry(const ProxyArgs& a, uint32_t next, uint32_t lane, uint64_t v) {
  const uint64_t* w = a.ring[next % CopyProxy::kRing].w;
  const uint32_t tag = next + 1;
  uint32_t* mb = a.st->mailbox[next % CopyProxy::kRing];
  const bool ok = static_cast<uint32_t>(v >> 32) == tag;
  if ((dev::Ballot(ok) & ((1u << kHeaderWords) - 1)) != (1u << kHeaderWords) - 1) return false;
  const uint32_t count = static_cast<uint32_t>(dev::ShflIdx(static_cast<int>(v), 0));
  const uint32_t words = kHeaderWords + kSegWords * min(count, CopyProxy::kMaxSegments);
  if (dev::Ballot(!ok && lane < words) != 0) return false;  // part of the first 32 not written yet
  if (lane < words) mb[lane] = static_cast<uint32_t>(v);
  // The rest: every load issued before any is used (one PCIe round trip, not
  // one per 32 words); a word still untagged is being written by the host now.
  constexpr uint32_t kMore = (kEntryWords + kWarp - 1) / kWarp - 1;
  uint64_t x[kMore];
#pragma unroll
  for (uint32_t k = 0; k < kMore; ++k) {
    const uint32_t i = (k + 1) * kWarp + lane;
    if (i < words) x[k] = LoadWord(w + i);
  }
#pragma unroll
  for (uint32_t k = 0; k < kMore; ++k) {
    const uint32_t i = (k + 1) * kWarp + lane;
    if (i < words) {
      while (static_cast<uint32_t>(x[k] >> 32) != tag) x[k] = LoadWord(w + i);
      mb[i] = static_cast<uint32_t>(x[k]);
    }
  }
  return true;
}

__device__ bool ReadEntry(const ProxyArgs& a, uint32_t next, uint32_t lane, uint64_t* v) {
  *v = LoadWord(a.ring[next % CopyProxy::kRing].w + lane);
  return TakeEntry(a, next, lane, *v);
}

// Copies a small entry whose words are all in the warp's registers (lane i
// holds word i: at most 4 segments) and publishes it: no mailbox read.
__device__ void LeaderCopyFromRegisters(uint64_t v, uint32_t lane) {
  auto word = [&](uint32_t i) { return static_cast<uint32_t>(dev::ShflIdx(static_cast<int>(v), static_cast<int>(i))); };
  const uint32_t count = word(0);
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t b = kHeaderWords + kSegWords * i;
    const uint64_t src = word(b) | static_cast<uint64_t>(word(b + 1)) << 32;
    const uint64_t dst = word(b + 2) | static_cast<uint64_t>(word(b + 3)) << 32;
    const uint32_t size = word(b + 4);
    for (uint32_t off = 0; off < size; off += 1u << kPieceShift)
      CopyPieceWarp(reinterpret_cast<const uint8_t*>(src) + off, reinterpret_cast<uint8_t*>(dst) + off,
                    min(1u << kPieceShift, size - off), lane);
  }
  const uint32_t value = word(2);
  const uint64_t flag = word(3) | static_cast<uint64_t>(word(4)) << 32;
  dev::SyncWarp();
  if (lane == 0) {
    dev::FenceSys();  // after the warp barrier: orders every lane's copies (cumulative)
    *reinterpret_cast<volatile uint32_t*>(static_cast<uintptr_t>(flag)) = value;
  }
  dev::SyncWarp();
}

// The leader (warp 0 of block 0): waits for ring entry `next`, hands it to
// the copy blocks, or decides to leave.
__device__ uint32_t LeaderWait(const ProxyArgs& a, uint32_t next, uint32_t lane) {
  // Mailbox slot and arrival counter of `next` were last used by entry
  // next - kRing: every block must be past it. Blocks without work in an entry
  // do not arrive, so nothing else bounds how far one may lag. (Checked before
  // polling the host: in steady state it costs no latency.)
  for (;;) {
    bool behind = false;
    for (uint32_t b = 1 + lane; b < gridDim.x; b += kWarp)
      behind |= static_cast<int32_t>(*reinterpret_cast<volatile uint32_t*>(&a.st->progress[b]) -
                                     (next + 1 - CopyProxy::kRing)) < 0;
    if (dev::Ballot(behind) == 0) break;
    dev::Backoff(64);
  }
  uint64_t idleSince = dev::GlobalTimerNs();
  // Two reads of the ring in flight, half a round trip apart: a new entry is
  // seen ~RTT/4 sooner on average than with one read at a time.
  const uint64_t* w = a.ring[next % CopyProxy::kRing].w + lane;
  uint64_t va = LoadWord(w);
  dev::Backoff(kPollStaggerNs);
  uint64_t vb = LoadWord(w);
  uint64_t v = 0;  // this lane's word of the entry taken
  for (uint32_t polls = 1;; ++polls) {
    if (TakeEntry(a, next, lane, va)) {
      v = va;
      break;
    }
    va = LoadWord(w);
    if (TakeEntry(a, next, lane, vb)) {
      v = vb;
      break;
    }
    vb = LoadWord(w);
    if (polls % kQuitPollEvery != 0) continue;
    int leave = 0;  // decided by lane 0: the warp must agree
    if (lane == 0) leave = dev::LoadAcquireSys(&a.ctl->quit) != 0 || dev::GlobalTimerNs() - idleSince >= a.idleNs;
    if (!dev::ShflIdx(leave, 0)) continue;
    // Leaving: announce it, then look once more (the host posts, fences, then
    // reads `state`: one of the two sides sees the other's store).
    if (lane == 0) dev::StoreReleaseSys(&a.ctl->state, 0);
    dev::FenceSys();
    dev::SyncWarp();
    if (ReadEntry(a, next, lane, &v)) {
      if (lane == 0) dev::StoreReleaseSys(&a.ctl->state, 1);
      break;
    }
    if (lane == 0) {
      a.st->tail = next;
      a.st->stopAt = next;
      dev::StoreReleaseSys(&a.st->stopEpoch, a.epoch);
    }
    return kCmdExit;
  }
  // A small entry the leader copies itself, before anything else: its
  // latency is the point. (The copy blocks skip it: see `needed`.)
  // Every segment has at least one piece (Post takes no empty ones), so an
  // entry of <= kLeaderPieces pieces has <= 4 segments: all its words are in
  // the warp's registers.
  const uint32_t pieces = static_cast<uint32_t>(dev::ShflIdx(static_cast<int>(v), 1));
  if (pieces <= kLeaderPieces) LeaderCopyFromRegisters(v, lane);
  __threadfence();  // each lane's mailbox words before `posted` ...
  dev::SyncWarp();  // ... and all lanes' before lane 0's store
  if (lane == 0) {
    // Device scope is enough: only this GPU's blocks read `posted`.
    *reinterpret_cast<volatile uint32_t*>(&a.st->posted) = next + 1;
    dev::StoreReleaseSys(&a.ctl->consumed, next + 1);  // the host may reuse the ring slot
  }
  return kCmdEntry;
}
// Copy blocks' thread 0: the leader's announcements live in device memory.
__device__ uint32_t FollowerWait(const ProxyArgs& a, uint32_t next) {
  for (;;) {
    if (static_cast<int32_t>(*reinterpret_cast<volatile uint32_t*>(&a.st->posted) - next) > 0) {
      __threadfence();  // acquire: the mailbox is read after `posted`
      return kCmdEntry;
    }
    if (dev::LoadAcquireSys(&a.st->stopEpoch) == a.epoch && *reinterpret_cast<volatile uint32_t*>(&a.st->stopAt) == next)
      return kCmdExit;
    dev::Backoff(64);
  }
}


__global__ void __launch_bounds__(CopyProxy::kThreads) ProxyKernel(const ProxyArgs a) {
  __shared__ uint32_t sCmd, sCount, sPieces, sValue;
  __shared__ uint32_t* sFlag;
  __shared__ uint32_t sFirst[CopyProxy::kMaxSegments];
  __shared__ CopySeg sSegs[CopyProxy::kMaxSegments];
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
  // Grids run one after another on the proxy's stream: the previous one's tail is final.
  uint32_t next = *reinterpret_cast<volatile uint32_t*>(&a.st->tail);
  if (blockIdx.x == 0) {
    // The leader block: one warp that only reads the ring, so it is already
    // polling for entry n + 1 while the copy blocks work on entry n.
    if (warp != 0) return;
    if (lane == 0) {
      dev::StoreReleaseSys(&a.ctl->state, 1);
      dev::FenceSys();
    }
    dev::SyncWarp();
    while (LeaderWait(a, next, lane) == kCmdEntry) ++next;
    return;
  }
  const uint32_t copier = blockIdx.x - 1, copiers = gridDim.x - 1;
  for (;;) {
    if (tid == 0) sCmd = FollowerWait(a, next);
    __syncthreads();
    if (sCmd == kCmdExit) return;
    // The leader's decoded entry, from device memory. Volatile: a mailbox
    // slot is reused, and L1 must not serve an old copy.
    const volatile uint32_t* mb = a.st->mailbox[next % CopyProxy::kRing];
    if (tid < CopyProxy::kMaxSegments) {
      const volatile uint32_t* sw = mb + kHeaderWords + kSegWords * tid;
      sSegs[tid].src = sw[0] | static_cast<uint64_t>(sw[1]) << 32;
      sSegs[tid].dst = sw[2] | static_cast<uint64_t>(sw[3]) << 32;
      sSegs[tid].size = sw[4];
      sFirst[tid] = sw[5];
    } else if (tid == CopyProxy::kMaxSegments) {
      sCount = mb[0];
      sPieces = mb[1];
      sValue = mb[2];
      sFlag = reinterpret_cast<uint32_t*>(mb[3] | static_cast<uint64_t>(mb[4]) << 32);
    }
    __syncthreads();
    for (uint32_t p = copier * warps + warp; p < sPieces; p += copiers * warps) {
      uint32_t lo = 0, hi = sCount - 1;  // the last segment whose first piece is <= p
      while (lo < hi) {
        const uint32_t mid = (lo + hi + 1) >> 1;
        if (sFirst[mid] <= p)
          lo = mid;
        else
          hi = mid - 1;
      }
      const CopySeg s = sSegs[lo];
      const uint64_t off = static_cast<uint64_t>(p - sFirst[lo]) << kPieceShift;
      const auto n = static_cast<uint32_t>(min(static_cast<uint64_t>(1) << kPieceShift, s.size - off));
      CopyPieceWarp(reinterpret_cast<const uint8_t*>(s.src) + off, reinterpret_cast<uint8_t*>(s.dst) + off, n, lane);
    }
    // Completion. After the barrier, thread 0's system-scope fence orders
    // every thread's copies before what it stores next (cumulativity: the
    // pattern of a cooperative-groups grid sync), so one fence per block does
    // what a fence per thread did. Entries of <= kLeaderPieces the leader
    // copied itself; one of <= 16 pieces belongs to the first copy block
    // alone, which publishes at once; otherwise the last block with pieces to
    // arrive publishes.
    const uint32_t byPieces = (sPieces + warps - 1) / warps;
    const uint32_t needed = sPieces <= kLeaderPieces ? 0u : (byPieces < copiers ? byPieces : copiers);
    __syncthreads();
    if (tid == 0) {
      if (copier < needed) {
        dev::FenceSys();
        bool last = needed == 1;
        if (!last) {
          uint32_t* arrive = &a.st->arrive[next % CopyProxy::kRing];
          last = atomicAdd(arrive, 1u) == needed - 1;
          if (last) {
            *arrive = 0;
            dev::FenceSys();
          }
        }
        if (last) *reinterpret_cast<volatile uint32_t*>(sFlag) = sValue;
      }
      dev::StoreReleaseSys(&a.st->progress[blockIdx.x], next + 1);
    }
    ++next;
  }
}

__global__ void PingPongKernel(const uint32_t* ping, uint32_t* pong, uint32_t iters) {
  for (uint32_t i = 1; i <= iters; ++i) {
    const uint64_t start = dev::GlobalTimerNs();
    while (*reinterpret_cast<const volatile uint32_t*>(ping) != i)
      if (dev::GlobalTimerNs() - start > 1000000000ull) return;  // the host gave up
    *reinterpret_cast<volatile uint32_t*>(pong) = i;
  }
}

}  // namespace

std::vector<double> PinnedPingPongUs(int device, int iters) {
  if (iters < 1 || iters > 1000000) throw InvalidArgument("iters=" + std::to_string(iters) + " must be in [1, 1000000]");
  DeviceGuard g(device);
  void* host = nullptr;
  void* devView = nullptr;
  gpuStream_t stream = nullptr;
  MORI_GPU_CHECK(gpuHostAlloc(&host, 2 * sizeof(uint32_t), gpuHostAllocMapped | gpuHostAllocPortable));
  auto* words = static_cast<volatile uint32_t*>(host);
  words[0] = words[1] = 0;
  std::vector<double> out;
  gpuError_t e = gpuHostGetDevicePointer(&devView, host, 0);
  if (e == gpuSuccess) e = gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking);
  if (e == gpuSuccess) {
    auto* d = static_cast<uint32_t*>(devView);
    PingPongKernel<<<1, 1, 0, stream>>>(d, d + 1, static_cast<uint32_t>(iters));
    e = gpuGetLastError();
  }
  bool late = false;
  if (e == gpuSuccess) {
    for (int i = 1; i <= iters && !late; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      __atomic_store_n(const_cast<uint32_t*>(&words[0]), static_cast<uint32_t>(i), __ATOMIC_SEQ_CST);
      while (__atomic_load_n(const_cast<uint32_t*>(&words[1]), __ATOMIC_ACQUIRE) != static_cast<uint32_t>(i)) {
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(1)) {
          late = true;
          break;
        }
      }
      out.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    e = gpuStreamSynchronize(stream);  // the kernel gives up within a second of a missing ping
  }
  if (stream) (void)gpuStreamDestroy(stream);
  (void)gpuFreeHost(host);
  MORI_GPU_CHECK(e);
  if (late) throw BadState("pinned ping-pong: the GPU did not answer within 1 s");
  return out;
}

CopyProxy::CopyProxy(int device, const ProxyConfig& config) : device_(device), config_(config) {
  DeviceGuard g(device_);
  auto fail = [this](gpuError_t e) {
    if (state_) (void)gpuFree(state_);
    if (ctl_) (void)gpuFreeHost(ctl_);
    if (ring_) (void)gpuFreeHost(ring_);
    if (stream_) (void)gpuStreamDestroy(stream_);
    MORI_GPU_CHECK(e);
  };
  gpuError_t e = gpuStreamCreateWithFlags(&stream_, gpuStreamNonBlocking);
  void* p = nullptr;
  if (e == gpuSuccess) e = gpuHostAlloc(&p, sizeof(ProxyEntry) * kRing, gpuHostAllocMapped | gpuHostAllocPortable);
  if (e == gpuSuccess) {
    ring_ = static_cast<ProxyEntry*>(p);
    std::memset(ring_, 0, sizeof(ProxyEntry) * kRing);
    e = gpuHostGetDevicePointer(&p, ring_, 0);
  }
  if (e == gpuSuccess) {
    ringDev_ = static_cast<ProxyEntry*>(p);
    e = gpuHostAlloc(&p, sizeof(ProxyControl), gpuHostAllocMapped | gpuHostAllocPortable);
  }
  if (e == gpuSuccess) {
    ctl_ = static_cast<ProxyControl*>(p);
    std::memset(ctl_, 0, sizeof(ProxyControl));
    e = gpuHostGetDevicePointer(&p, ctl_, 0);
  }
  if (e == gpuSuccess) {
    ctlDev_ = static_cast<ProxyControl*>(p);
    e = gpuMalloc(&p, sizeof(ProxyDeviceState));
  }
  if (e == gpuSuccess) {
    state_ = static_cast<ProxyDeviceState*>(p);
    e = gpuMemset(state_, 0, sizeof(ProxyDeviceState));
  }
  if (e != gpuSuccess) fail(e);
}

CopyProxy::~CopyProxy() {
  DeviceGuard g(device_);
  __atomic_store_n(&ctl_->quit, 1u, __ATOMIC_RELEASE);
  // A resident grid leaves within one quit poll; give a busy GPU time to schedule it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (true) {
    const gpuError_t e = gpuStreamQuery(stream_);
    if (e != gpuErrorNotReady) {
      (void)gpuGetLastError();
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      // Its memory stays allocated: a grid that is still running may touch it.
      MORI_ERROR("XGMI copy proxy on GPU " << device_ << " did not leave within 5 s of shutdown; abandoning it");
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  (void)gpuFree(state_);
  (void)gpuFreeHost(ctl_);
  (void)gpuFreeHost(ring_);
  (void)gpuStreamDestroy(stream_);
}

uint64_t CopyProxy::Launches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

bool CopyProxy::Post(const CopySeg* segs, size_t count, uint64_t totalBytes, const KernelSignal& signal) {
  if (count == 0 || count > kMaxSegments || totalBytes > config_.maxBytes) return false;
  // The engine drops empty segments before a backend sees them; the kernel
  // relies on it (a segment is at least one piece), so anything else is launched.
  for (size_t i = 0; i < count; ++i)
    if (segs[i].size == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_ || head_ - __atomic_load_n(&ctl_->consumed, __ATOMIC_ACQUIRE) >= kRing) return false;
  // Every word tagged with the entry's number (see ProxyEntry); segments
  // first, the header last, so the leader rarely sees half an entry.
  uint64_t* w = ring_[head_ % kRing].w;
  const uint64_t tag = static_cast<uint64_t>(head_ + 1) << 32;
  auto put = [&](uint32_t i, uint64_t v) { __atomic_store_n(&w[i], tag | (v & 0xffffffffu), __ATOMIC_RELAXED); };
  uint64_t pieces = 0;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t b = kHeaderWords + kSegWords * static_cast<uint32_t>(i);
    put(b + 0, segs[i].src);
    put(b + 1, segs[i].src >> 32);
    put(b + 2, segs[i].dst);
    put(b + 3, segs[i].dst >> 32);
    put(b + 4, segs[i].size);  // <= maxBytes <= 256 MiB
    put(b + 5, pieces);
    pieces += (segs[i].size + (1u << kPieceShift) - 1) >> kPieceShift;
  }
  const auto flag = reinterpret_cast<uint64_t>(signal.flag);
  put(4, flag >> 32);
  put(3, flag);
  put(2, signal.value);
  put(1, pieces);
  put(0, count);
  ++head_;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(&ctl_->state, __ATOMIC_ACQUIRE) == 0) {
    __atomic_store_n(&ctl_->state, 1u, __ATOMIC_RELEASE);
    LaunchGrid();
  }
  return true;
}

void CopyProxy::LaunchGrid() {
  const ProxyArgs a{ringDev_, ctlDev_, state_, ++epoch_, static_cast<uint64_t>(config_.idleUs) * 1000};
  ProxyKernel<<<static_cast<uint32_t>(config_.blocks) + 1, kThreads, 0, stream_>>>(a);  // + the leader
  const gpuError_t e = gpuGetLastError();
  if (e != gpuSuccess) {
    // The entry just posted will never be consumed; its caller reports the
    // error, and nothing more is taken (later transfers use launches).
    broken_ = true;
    MORI_GPU_CHECK(e);
  }
}

}  // namespace mori::io::p2p
