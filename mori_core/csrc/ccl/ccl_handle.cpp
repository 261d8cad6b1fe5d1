#include "ccl/ccl_handle.hpp"

#if MORI_WITH_GPU
#include <algorithm>
#include <cstring>

#include "ccl/ccl_kernels.hpp"
#include "ccl/stream_memops.hpp"
#include "common/error.hpp"
#include "common/logging.hpp"
#include "shmem/gpu_ext.hpp"
#include "shmem/shmem_state.hpp"

namespace mori::ccl {
namespace {

constexpr uint64_t kAlign = 256;
uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kAllGather: return "all-gather";
    case Kind::kAllToAll: return "all-to-all";
    default: return "all-reduce";
  }
}

const char* SiteName(uint32_t where) {
  switch (where) {
    case kSiteStaged: return "its input staged";
    case kSitePushed: return "its data pushed into this rank's slots";
    case kSiteReduced: return "its reduced shard";
    case kSiteClose: return "its close()";
    default: return "a signal";
  }
}

bool Capturing(gpuStream_t s) {
#if defined(MORI_GPU_HIP)
  hipStreamCaptureStatus st = hipStreamCaptureStatusNone;
  return hipStreamIsCapturing(s, &st) == hipSuccess && st != hipStreamCaptureStatusNone;
#else
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
#endif
}

}  // namespace

const char* PathName(Path p) {
  switch (p) {
    case Path::kSmAllGather: return "sm";
    case Path::kSmAllToAll: return "sm";
    case Path::kSmOneShot: return "sm-oneshot";
    case Path::kSmTwoShot: return "sm-twoshot";
    case Path::kCeAllGather: return "ce";
    case Path::kCeAllToAll: return "ce";
    case Path::kCeAllReduce: return "ce";
    default: return "none";
  }
}

CclHandle::CclHandle(Kind kind, int rank, int npes, uint64_t input_bytes, RedType red, const Options& opt)
    : kind_(kind), rank_(rank), npes_(npes), input_bytes_(input_bytes), red_(red), esize_(RedTypeSize(red)), opt_(opt) {
  shmem::SymmetricHeap& heap = shmem::Heap();
  if (rank != heap.rank() || npes != heap.world_size())
    throw InvalidArgument("my_pe/npes (" + std::to_string(rank) + "/" + std::to_string(npes) + ") differ from shmem's (" +
                          std::to_string(heap.rank()) + "/" + std::to_string(heap.world_size()) + ")");
  if (npes > kMaxPeers) throw InvalidArgument("npes=" + std::to_string(npes) + " exceeds " + std::to_string(kMaxPeers) + " (one node)");
  if (opt.sm_blocks < 1 || opt.sm_blocks > kMaxSmBlocks)
    throw InvalidArgument("sm_blocks=" + std::to_string(opt.sm_blocks) + " must be in [1, " + std::to_string(kMaxSmBlocks) + "]");
  if (opt.sm_threads < 64 || opt.sm_threads > 1024 || opt.sm_threads % 32)
    throw InvalidArgument("sm_threads=" + std::to_string(opt.sm_threads) + " must be a multiple of 32 in [64, 1024]");
  if (!(opt.timeout_s > 0)) throw InvalidArgument("timeout_s must be positive");
  if (opt.ce_split < 1 || opt.ce_split > kMaxCeSplit)
    throw InvalidArgument("ce_split=" + std::to_string(opt.ce_split) + " must be in [1, " + std::to_string(kMaxCeSplit) + "]");
  if (kind == Kind::kAllReduce && red == RedType::kNone) throw InvalidArgument("an all-reduce needs a dtype");
  device_ = heap.device();
  generation_ = shmem::Generation();
  DeviceGuard guard(device_);
  MORI_GPU_CHECK(gpuDeviceGetAttribute(&sm_count_, gpuDevAttrMultiProcessorCount, device_));

  const bool ce_possible = StreamMemOpsUnavailable().empty();
  if (opt.engine == Engine::kCopy && !ce_possible)
    throw InvalidArgument("engine='ce' needs CUDA stream memory operations: " + StreamMemOpsUnavailable());
  const Engine eng = opt.engine;
  if (kind != Kind::kAllReduce) {
    ce_enabled_ = ce_possible && (eng == Engine::kCopy || (eng == Engine::kAuto && input_bytes >= opt.ce_min_bytes));
    sm_enabled_ = eng != Engine::kCopy;
    sm_cap_ = (eng == Engine::kSm || !ce_enabled_) ? input_bytes : std::min(input_bytes, opt.ce_min_bytes);
  } else {
    ce_enabled_ = ce_possible && (eng == Engine::kCopy || (eng == Engine::kAuto && input_bytes >= opt.ar_ce_min_bytes));
    sm_enabled_ = eng != Engine::kCopy;
    sm_cap_ = std::min(input_bytes, opt.oneshot_max_bytes);
    const uint64_t ts_limit = (eng == Engine::kSm || !ce_enabled_) ? input_bytes : std::min(input_bytes, opt.ar_ce_min_bytes);
    twoshot_enabled_ = sm_enabled_ && input_bytes > opt.oneshot_max_bytes && ts_limit > opt.oneshot_max_bytes;
    ts_cap_ = twoshot_enabled_ ? ts_limit : 0;
    if (sm_cap_ == 0) sm_enabled_ = twoshot_enabled_;
  }

  try {
    // Sync block: epoch, done, claim | flags A | flags B | ce freed | ce ready | ce ready2 | consts {0, 1}.
    const uint64_t nflags = static_cast<uint64_t>(kMaxSmBlocks) * npes;
    const uint64_t sync_bytes = RoundUp(kAlign + 2 * nflags * 4 + 3 * npes * 4 + 8, kAlign);
    sync_ = Alloc(sync_bytes);
    sync_offset_ = static_cast<uint64_t>(sync_.local - heap.base());
    MORI_GPU_CHECK(gpuMemset(sync_.local, 0, sync_bytes));
    auto at = [&](uint8_t* base, uint64_t off) { return reinterpret_cast<uint32_t*>(base + off); };
    sm_.epoch = at(sync_.local, 0);
    sm_.done = at(sync_.local, 4);
    sm_.claim = at(sync_.local, 8);
    for (int w = 0; w < 2; ++w) {
      sm_.flags[w] = at(sync_.local, kAlign + w * nflags * 4);
      for (int p = 0; p < npes; ++p) sm_.peer_flags[w][p] = at(sync_.peer[p], kAlign + w * nflags * 4);
    }
    const uint64_t ce_off = kAlign + 2 * nflags * 4;
    ce_freed_ = at(sync_.local, ce_off);
    ce_ready_ = at(sync_.local, ce_off + npes * 4);
    ce_ready2_ = at(sync_.local, ce_off + 2 * npes * 4);
    ce_consts_ = at(sync_.local, ce_off + 3 * npes * 4);
    std::vector<uint32_t> init(npes, 1u);
    MORI_GPU_CHECK(gpuMemcpy(ce_freed_, init.data(), npes * 4, gpuMemcpyHostToDevice));  // nothing to wait for yet
    const uint32_t consts[2] = {0u, 1u};
    MORI_GPU_CHECK(gpuMemcpy(ce_consts_, consts, sizeof(consts), gpuMemcpyHostToDevice));
    sm_.rank = rank;
    sm_.npes = npes;
    sm_.timeout_ns = static_cast<uint64_t>(opt.timeout_s * 1e9);

    void* host = nullptr;
    MORI_GPU_CHECK(gpuHostAlloc(&host, sizeof(ErrorRecord), gpuHostAllocMapped | gpuHostAllocPortable));
    err_host_ = static_cast<ErrorRecord*>(host);
    std::memset(err_host_, 0, sizeof(ErrorRecord));
    void* dev = nullptr;
    MORI_GPU_CHECK(gpuHostGetDevicePointer(&dev, host, 0));
    err_dev_ = static_cast<ErrorRecord*>(dev);
    sm_.error = err_dev_;

    if (sm_enabled_) {
      if (kind == Kind::kAllReduce) {
        if (sm_cap_ > 0) {
          sm_slot_bytes_ = RoundUp(sm_cap_, kAlign);
          sm_buf_ = Alloc(2 * npes * sm_slot_bytes_);
        }
        if (twoshot_enabled_) {
          ts_slot_bytes_ = RoundUp(ShardElems(ts_cap_ / esize_) * esize_, kAlign);
          ts_buf_ = Alloc(2 * npes * ts_slot_bytes_);
          sm_red_ = Alloc(2 * ts_slot_bytes_);
        }
      } else {
        sm_buf_ = Alloc(2 * RoundUp(std::max<uint64_t>(sm_cap_, 1), kAlign));
      }
    }
    if (ce_enabled_) {
      if (kind == Kind::kAllReduce) {
        ce_slot_bytes_ = RoundUp(ShardElems(input_bytes / esize_) * esize_, kAlign);
        ce_buf_ = Alloc(npes * ce_slot_bytes_);
        ce_red_ = Alloc(ce_slot_bytes_);
      } else {
        ce_buf_ = Alloc(RoundUp(std::max<uint64_t>(input_bytes, 1), kAlign));
      }
      streams_.resize(npes + 1, nullptr);
      join_ev_.resize(npes + 1, nullptr);
      for (int i = 0; i <= npes; ++i) {
        MORI_GPU_CHECK(gpuStreamCreateWithFlags(&streams_[i], gpuStreamNonBlocking));
        MORI_GPU_CHECK(gpuEventCreateWithFlags(&join_ev_[i], gpuEventDisableTiming));
      }
      const int extra = opt.ce_split - 1;
      piece_streams_.resize(static_cast<size_t>(npes) * extra, nullptr);
      piece_join_ev_.resize(piece_streams_.size(), nullptr);
      piece_fork_ev_.resize(extra > 0 ? npes : 0, nullptr);
      for (size_t i = 0; i < piece_streams_.size(); ++i) {
        MORI_GPU_CHECK(gpuStreamCreateWithFlags(&piece_streams_[i], gpuStreamNonBlocking));
        MORI_GPU_CHECK(gpuEventCreateWithFlags(&piece_join_ev_[i], gpuEventDisableTiming));
      }
      for (auto& e : piece_fork_ev_) MORI_GPU_CHECK(gpuEventCreateWithFlags(&e, gpuEventDisableTiming));
      MORI_GPU_CHECK(gpuEventCreateWithFlags(&fork_ev_, gpuEventDisableTiming));
      MORI_GPU_CHECK(gpuEventCreateWithFlags(&fork_main_ev_, gpuEventDisableTiming));
      MORI_GPU_CHECK(gpuStreamCreateWithFlags(&diag_stream_, gpuStreamNonBlocking));
      std::vector<int> others;
      for (int p = 0; p < npes; ++p)
        if (p != rank) others.push_back(p);
      AddSite("every peer finished reading this rank's buffers of the previous call", ce_freed_, others);
      for (int p = 0; p < npes; ++p)
        AddSite(kind == Kind::kAllReduce ? "its reduce-scatter data" : "its input staged", ce_ready_, {p});
      if (kind == Kind::kAllReduce)
        for (int p = 0; p < npes; ++p) AddSite("its reduced shard", ce_ready2_, {p});
      void* busy = nullptr;
      MORI_GPU_CHECK(gpuHostAlloc(&busy, sites_.size() * 4, gpuHostAllocMapped | gpuHostAllocPortable));
      busy_host_ = static_cast<uint32_t*>(busy);
      std::memset(busy_host_, 0, sites_.size() * 4);
      void* busy_dev = nullptr;
      MORI_GPU_CHECK(gpuHostGetDevicePointer(&busy_dev, busy, 0));
      busy_dev_ = static_cast<uint32_t*>(busy_dev);
      WatchSites(this, busy_host_, static_cast<int>(sites_.size()), opt.timeout_s);
      watched_ = true;
    }
    MORI_GPU_CHECK(gpuEventCreateWithFlags(&last_ev_, gpuEventDisableTiming));
    MORI_GPU_CHECK(gpuDeviceSynchronize());
  } catch (...) {
    closed_ = true;  // nothing was shared yet: free without the close barrier
    if (watched_) UnwatchSites(this);
    Free(ce_red_); Free(ce_buf_); Free(sm_red_); Free(ts_buf_); Free(sm_buf_); Free(sync_);
    throw;
  }
}

CclHandle::~CclHandle() {
  try {
    Close();
  } catch (const std::exception& e) {
    MORI_WARN("mori ccl: closing a " << KindName(kind_) << " handle failed: " << e.what());
  }
}

int CclHandle::AddSite(const std::string& name, uint32_t* flags, const std::vector<int>& peers) {
  sites_.push_back(CeSite{name, peers, flags});
  return static_cast<int>(sites_.size()) - 1;
}

CclHandle::Region CclHandle::Alloc(uint64_t bytes) {
  Region r;
  if (bytes == 0) return r;
  shmem::SymmetricHeap& heap = shmem::Heap();
  r.local = static_cast<uint8_t*>(heap.Malloc(bytes, kAlign));
  r.bytes = bytes;
  for (int p = 0; p < npes_; ++p) r.peer[p] = static_cast<uint8_t*>(heap.PeerPtr(r.local, p));
  heap_bytes_ += bytes;
  return r;
}

void CclHandle::Free(Region& r) {
  if (!r.local) return;
  if (generation_ == shmem::Generation() && shmem::Initialized()) shmem::Heap().Free(r.local);
  heap_bytes_ -= r.bytes;
  r = Region();
}

uint64_t CclHandle::ShardElems(uint64_t count) const {
  const uint64_t v = 16 / esize_;
  return RoundUp((count + npes_ - 1) / npes_, v);
}

uint32_t* CclHandle::ce_peer(uint32_t* local, int p) const {
  return reinterpret_cast<uint32_t*>(sync_.peer[p] + (reinterpret_cast<uint8_t*>(local) - sync_.local));
}

Path CclHandle::Choose(uint64_t nbytes) const {
  const Engine eng = opt_.engine;
  switch (kind_) {
    case Kind::kAllGather:
    case Kind::kAllToAll: {
      const uint64_t total = kind_ == Kind::kAllToAll ? nbytes * npes_ : nbytes;
      const bool ce = eng == Engine::kCopy || (eng == Engine::kAuto && ce_enabled_ && total >= opt_.ce_min_bytes);
      if (kind_ == Kind::kAllGather) return ce ? Path::kCeAllGather : Path::kSmAllGather;
      return ce ? Path::kCeAllToAll : Path::kSmAllToAll;
    }
    default:
      if (eng == Engine::kCopy) return Path::kCeAllReduce;
      if (nbytes <= opt_.oneshot_max_bytes) return Path::kSmOneShot;
      if (eng == Engine::kAuto && ce_enabled_ && nbytes >= opt_.ar_ce_min_bytes) return Path::kCeAllReduce;
      return Path::kSmTwoShot;
  }
}

std::string CclHandle::Error() const {
  std::lock_guard<std::mutex> lk(err_mu_);
  if (!ce_error_.empty()) return ce_error_;
  if (!err_host_) return "";
  const volatile ErrorRecord* r = err_host_;
  if (r->code == kErrNone) return "";
  return std::string("mori ccl ") + KindName(kind_) + " on rank " + std::to_string(rank_) + ": timed out after " +
         std::to_string(opt_.timeout_s) + " s waiting for peer rank " + std::to_string(r->peer) + " (" +
         SiteName(r->where) + ", SM kernel block " + std::to_string(r->block) + ", call " + std::to_string(r->epoch) + ")";
}

void CclHandle::ThrowIfFailed() const {
  if (closed_) throw BadState(std::string("mori ccl: this ") + KindName(kind_) + " handle is closed");
  const std::string e = Error();
  if (!e.empty())
    throw BadState(e + "; the handle cannot be used again: close it on every rank and build a new one");
}

bool CclHandle::OnStuck(int site) {
  const CeSite& st = sites_[site];
  DeviceGuard guard(device_);
  std::vector<uint32_t> vals(npes_, 0);
  if (gpuMemcpyAsync(vals.data(), st.flags, npes_ * 4, gpuMemcpyDeviceToHost, diag_stream_) != gpuSuccess ||
      gpuStreamSynchronize(diag_stream_) != gpuSuccess) {
    (void)gpuGetLastError();
    return false;
  }
  std::vector<int> missing;
  for (int p : st.peers)
    if (vals[p] != 1u) missing.push_back(p);
  if (missing.empty()) return false;  // the signals are there: the stream is about to move on
  {
    std::lock_guard<std::mutex> lk(err_mu_);
    if (ce_error_.empty()) {
      std::string who;
      for (size_t i = 0; i < missing.size(); ++i) who += (i ? ", " : "") + std::to_string(missing[i]);
      ce_error_ = std::string("mori ccl ") + KindName(kind_) + " on rank " + std::to_string(rank_) + ": timed out after " +
                  std::to_string(opt_.timeout_s) + " s waiting for peer rank " + who + " (copy engines: " + st.name + ")";
      MORI_ERROR(ce_error_);
    }
  }
  // Release the stream (its results are void; the handle now refuses calls).
  static const uint32_t one = 1u;
  for (int p : missing) (void)gpuMemcpyAsync(st.flags + p, &one, 4, gpuMemcpyHostToDevice, diag_stream_);
  (void)gpuStreamSynchronize(diag_stream_);
  (void)gpuGetLastError();
  return true;
}

void CclHandle::OrderAfterLast(gpuStream_t s) {
  if (!has_last_ || last_stream_ == s) return;
  if (Capturing(s) || Capturing(last_stream_)) return;  // a capture starts after a synchronize
  // The previous call's stream may be gone (a destroyed user stream): then nothing to order after.
  if (gpuEventRecord(last_ev_, last_stream_) != gpuSuccess) {
    (void)gpuGetLastError();
    return;
  }
  MORI_GPU_CHECK(gpuStreamWaitEvent(s, last_ev_, 0));
}

void CclHandle::MarkLast(gpuStream_t s) {
  last_stream_ = s;
  has_last_ = true;
}

int CclHandle::SmBlocks(Path path, uint64_t nbytes) const {
  uint64_t units = 0;
  switch (path) {
    case Path::kSmOneShot: units = nbytes / 16 + 1; break;
    case Path::kSmTwoShot: units = ShardElems(nbytes / esize_) * esize_ / 16 + 1; break;
    default: units = nbytes / 16 + 1; break;
  }
  const uint64_t b = (units + opt_.sm_threads - 1) / opt_.sm_threads;
  return static_cast<int>(std::min<uint64_t>(std::max<uint64_t>(b, 1), opt_.sm_blocks));
}

SmArgs CclHandle::MakeSmArgs(Path path, uintptr_t in, uintptr_t out, uint64_t nbytes) const {
  SmArgs a{};
  a.in = reinterpret_cast<const uint8_t*>(in);
  a.out = reinterpret_cast<uint8_t*>(out);
  a.nbytes = nbytes;
  const Region& buf = path == Path::kSmTwoShot ? ts_buf_ : sm_buf_;
  a.buf = buf.local;
  for (int p = 0; p < npes_; ++p) a.peer_buf[p] = buf.peer[p];
  a.buf_parity = buf.bytes / 2;
  if (kind_ == Kind::kAllReduce) {
    a.count = nbytes / esize_;
    a.slot_bytes = path == Path::kSmTwoShot ? ts_slot_bytes_ : sm_slot_bytes_;
    if (path == Path::kSmTwoShot) {
      a.shard = ShardElems(a.count);
      a.red = sm_red_.local;
      for (int p = 0; p < npes_; ++p) a.peer_red[p] = sm_red_.peer[p];
      a.red_parity = sm_red_.bytes / 2;
    }
  }
  return a;
}

void CclHandle::LaunchSm(Path path, uintptr_t in, uintptr_t out, uint64_t nbytes, int phase, gpuStream_t s) {
  const SmArgs a = MakeSmArgs(path, in, out, nbytes);
  LaunchSmCollective(path, red_, sm_, a, phase, SmBlocks(path, nbytes), opt_.sm_threads, s);
}

static bool IsCe(Path p) { return p == Path::kCeAllGather || p == Path::kCeAllToAll || p == Path::kCeAllReduce; }

Path CclHandle::Run(uintptr_t in, uintptr_t out, uint64_t nbytes, uintptr_t stream) {
  ThrowIfFailed();
  if (pending_.active) throw BadState("mori ccl: start_async is pending on this handle; call wait_async first");
  if (nbytes == 0) return Path::kNone;
  const Path path = Choose(nbytes);
  gpuStream_t s = reinterpret_cast<gpuStream_t>(stream);
  DeviceGuard guard(device_);
  OrderAfterLast(s);
  if (IsCe(path)) {
    CeStart(path, in, out, nbytes, s);
    CeFinish(s);
  } else {
    LaunchSm(path, in, out, nbytes, kPhaseFull, s);
  }
  MarkLast(s);
  return path;
}

Path CclHandle::Start(uintptr_t in, uintptr_t out, uint64_t nbytes, uintptr_t stream) {
  ThrowIfFailed();
  if (pending_.active) throw BadState("mori ccl: start_async is already pending on this handle; call wait_async first");
  gpuStream_t s = reinterpret_cast<gpuStream_t>(stream);
  Pending p;
  p.active = true;
  p.path = nbytes == 0 ? Path::kNone : Choose(nbytes);
  p.in = in;
  p.out = out;
  p.nbytes = nbytes;
  p.stream = s;
  if (p.path != Path::kNone) {
    DeviceGuard guard(device_);
    OrderAfterLast(s);
    if (IsCe(p.path))
      CeStart(p.path, in, out, nbytes, s);
    else
      LaunchSm(p.path, in, out, nbytes, kPhaseStart, s);
    MarkLast(s);
  }
  pending_ = p;
  return p.path;
}

Path CclHandle::Finish(uintptr_t stream) {
  if (!pending_.active) throw BadState("mori ccl: wait_async without a pending start_async");
  const Pending p = pending_;
  pending_ = Pending();
  if (p.path == Path::kNone) return p.path;
  gpuStream_t s = reinterpret_cast<gpuStream_t>(stream);
  DeviceGuard guard(device_);
  if (IsCe(p.path)) {
    CeFinish(s);  // joins every stream the start forked
  } else {
    OrderAfterLast(s);
    LaunchSm(p.path, p.in, p.out, p.nbytes, kPhaseFinish, s);
  }
  MarkLast(s);
  ThrowIfFailed();
  return p.path;
}

void CclHandle::Close() {
  if (closed_) return;
  closed_ = true;
  const bool heap_alive = generation_ == shmem::Generation() && shmem::Initialized();
  DeviceGuard guard(device_);
  if (heap_alive && (gpuDeviceSynchronize() == gpuSuccess)) {
    if (Error().empty()) {
      // A last barrier round: every peer finished every call that reads this rank's buffers.
      gpuStream_t s = nullptr;
      if (gpuStreamCreateWithFlags(&s, gpuStreamNonBlocking) == gpuSuccess) {
        LaunchClose(sm_, ce_enabled_ ? ce_freed_ : nullptr, s);
        (void)gpuStreamSynchronize(s);
        (void)gpuStreamDestroy(s);
        const std::string e = Error();
        if (!e.empty()) MORI_WARN(e << "; freeing this handle's buffers anyway");
      }
    }
  }
  (void)gpuGetLastError();
  if (watched_) {  // only now: the synchronize above relies on the watchdog to end a stuck wait
    UnwatchSites(this);
    watched_ = false;
  }
  Free(ce_red_);
  Free(ce_buf_);
  Free(sm_red_);
  Free(ts_buf_);
  Free(sm_buf_);
  Free(sync_);
  for (auto& s : streams_)
    if (s) (void)gpuStreamDestroy(s);
  for (auto& e : join_ev_)
    if (e) (void)gpuEventDestroy(e);
  streams_.clear();
  join_ev_.clear();
  for (auto& s : piece_streams_)
    if (s) (void)gpuStreamDestroy(s);
  for (auto* v : {&piece_join_ev_, &piece_fork_ev_})
    for (auto& e : *v)
      if (e) (void)gpuEventDestroy(e);
  piece_streams_.clear();
  piece_join_ev_.clear();
  piece_fork_ev_.clear();
  for (gpuEvent_t* e : {&fork_ev_, &fork_main_ev_, &last_ev_})
    if (*e) {
      (void)gpuEventDestroy(*e);
      *e = nullptr;
    }
  if (diag_stream_) (void)gpuStreamDestroy(diag_stream_);
  diag_stream_ = nullptr;
  if (busy_host_) (void)gpuFreeHost(busy_host_);
  busy_host_ = nullptr;
  {
    std::lock_guard<std::mutex> lk(err_mu_);
    if (err_host_) (void)gpuFreeHost(err_host_);
    err_host_ = nullptr;
  }
}

void CclHandle::ResetFlags() {
  if (closed_) throw BadState(std::string("mori ccl: this ") + KindName(kind_) + " handle is closed");
  if (pending_.active) throw BadState("mori ccl: reset_flags with a start_async pending");
  DeviceGuard guard(device_);
  MORI_GPU_CHECK(gpuDeviceSynchronize());
  MORI_GPU_CHECK(gpuMemset(sync_.local, 0, sync_.bytes));
  std::vector<uint32_t> init(npes_, 1u);
  MORI_GPU_CHECK(gpuMemcpy(ce_freed_, init.data(), npes_ * 4, gpuMemcpyHostToDevice));
  const uint32_t consts[2] = {0u, 1u};
  MORI_GPU_CHECK(gpuMemcpy(ce_consts_, consts, sizeof(consts), gpuMemcpyHostToDevice));
  if (busy_host_) std::memset(busy_host_, 0, sites_.size() * 4);
  std::lock_guard<std::mutex> lk(err_mu_);
  std::memset(err_host_, 0, sizeof(ErrorRecord));
  ce_error_.clear();
  has_last_ = false;
}

}  // namespace mori::ccl
#endif  // MORI_WITH_GPU
