#include "io/p2p/xgmi_backend.hpp"

#include <algorithm>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/logging.hpp"
#include "io/p2p/ipc_cache.hpp"
#include "io/submit_profile.hpp"

namespace mori::io::p2p {
namespace {

class XgmiSession : public BackendSession {
 public:
  XgmiSession(XgmiBackend& backend, XgmiBackend::Route route, std::shared_ptr<LocalRegion> region)
      : backend_(backend), route_(std::move(route)), region_(std::move(region)) {}

  void Submit(SegmentList segments, TransferUniqueId uid, bool isRead, const StatusPtr& status) override {
    RegionPin pin(region_);
    if (!pin) {
      status->Update(StatusCode::ERR_NOT_FOUND, "local memory was deregistered");
      return;
    }
    std::vector<XgmiBackend::Job> jobs;
    jobs.push_back({&route_, &segments, uid, status, std::move(pin)});
    backend_.Launch(jobs, isRead);
  }
  bool Alive() const override { return true; }

 private:
  XgmiBackend& backend_;
  XgmiBackend::Route route_;
  std::shared_ptr<LocalRegion> region_;
};

}  // namespace

XgmiTuning XgmiTuning::FromEnv() {
  XgmiTuning t;
  t.kernelMinSegments = static_cast<int>(env::GetInt("MORI_IO_XGMI_KERNEL_MIN_SEGMENTS", t.kernelMinSegments));
  t.kernelMaxAvgBytes = env::GetSize("MORI_IO_XGMI_KERNEL_MAX_AVG_BYTES", t.kernelMaxAvgBytes);
  const int64_t batch = env::GetInt("MORI_IO_XGMI_CE_BATCH", t.copyEngineBatch ? 1 : 0);
  if (batch != 0 && batch != 1)
    throw InvalidArgument("MORI_IO_XGMI_CE_BATCH=" + std::to_string(batch) + " must be 0 or 1");
  t.copyEngineBatch = batch == 1;
  const uint64_t piece = env::GetSize("MORI_IO_XGMI_PIECE_BYTES", t.shape.pieceBytes);
  if (piece < 4096 || piece > (1u << 20) || (piece & (piece - 1)) != 0)
    throw InvalidArgument("MORI_IO_XGMI_PIECE_BYTES=" + std::to_string(piece) +
                          " must be a power of two in [4096, 1048576]");
  t.shape.pieceBytes = static_cast<uint32_t>(piece);
  const int64_t threads = env::GetInt("MORI_IO_XGMI_BLOCK_THREADS", t.shape.threads);
  if (threads < 64 || threads > 1024 || threads % 32 != 0)
    throw InvalidArgument("MORI_IO_XGMI_BLOCK_THREADS=" + std::to_string(threads) +
                          " must be a multiple of 32 in [64, 1024]");
  t.shape.threads = static_cast<uint32_t>(threads);
  const int64_t blocks = env::GetInt("MORI_IO_XGMI_MAX_BLOCKS", t.shape.maxBlocks);
  if (blocks < 0 || blocks > 65536)
    throw InvalidArgument("MORI_IO_XGMI_MAX_BLOCKS=" + std::to_string(blocks) +
                          " must be in [0, 65536] (0: one block per piece)");
  t.shape.maxBlocks = static_cast<uint32_t>(blocks);
  const uint64_t readPiece = env::GetSize("MORI_IO_XGMI_READ_PIECE_BYTES", t.largeReadPieceBytes);
  if (readPiece < 4096 || readPiece > (1u << 20) || (readPiece & (readPiece - 1)) != 0)
    throw InvalidArgument("MORI_IO_XGMI_READ_PIECE_BYTES=" + std::to_string(readPiece) +
                          " must be a power of two in [4096, 1048576]");
  t.largeReadPieceBytes = static_cast<uint32_t>(readPiece);
  return t;
}

namespace {

// One setting: the config field, or its environment variable when that is
// set; out of [lo, hi] raises naming whichever it came from.
int64_t ProxySetting(const char* var, const char* field, int64_t fromConfig, int64_t lo, int64_t hi, bool size) {
  const bool fromEnv = env::GetString(var).has_value();
  const int64_t v = !fromEnv ? fromConfig
                    : size   ? static_cast<int64_t>(env::GetSize(var, 0))
                             : env::GetInt(var, fromConfig);
  if (v < lo || v > hi)
    throw InvalidArgument(std::string(fromEnv ? var : field) + "=" + std::to_string(v) + " must be in [" +
                          std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

// The copy proxy's settings (a framework adapter's engine can be tuned by
// environment without code).
ProxyConfig ProxySettings(const XgmiBackendConfig& c) {
  ProxyConfig p;
  p.blocks = static_cast<int>(ProxySetting("MORI_IO_XGMI_PROXY_BLOCKS", "XgmiBackendConfig.proxy_blocks",
                                           c.proxyBlocks, 0, CopyProxy::kMaxBlocks, false));
  p.maxBytes = static_cast<uint64_t>(ProxySetting("MORI_IO_XGMI_PROXY_MAX_BYTES", "XgmiBackendConfig.proxy_max_bytes",
                                                  c.proxyMaxBytes, 4096, 256ll << 20, true));
  p.idleUs = static_cast<uint32_t>(ProxySetting("MORI_IO_XGMI_PROXY_IDLE_US", "XgmiBackendConfig.proxy_idle_us",
                                                c.proxyIdleUs, 10, 10000000, false));
  return p;
}

}  // namespace

XgmiBackend::XgmiBackend(EngineContext& ctx, const XgmiBackendConfig& config)
    : ctx_(ctx), config_(config), tuning_(XgmiTuning::FromEnv()) {
  if (config_.numStreams < 1 || config_.numStreams > 1024)
    throw InvalidArgument("XgmiBackendConfig.num_streams=" + std::to_string(config_.numStreams) +
                          " must be in [1, 1024]");
  if (config_.numEvents < 1 || config_.numEvents > 65536)
    throw InvalidArgument("XgmiBackendConfig.num_events=" + std::to_string(config_.numEvents) +
                          " must be in [1, 65536]");
  const ProxyConfig proxy = ProxySettings(config_);
  if (GpuDeviceCount() == 0) throw BadState("XGMI backend: no GPU is visible to this process");
  pool_ = std::make_shared<StreamPool>(config_.numStreams, config_.numEvents, proxy);
  notifier_ = std::make_unique<NotificationSender>(ctx_);
  waiter_ = std::make_unique<CompletionWaiter>(notifier_.get());
}

XgmiBackend::~XgmiBackend() {
  waiter_.reset();  // waits for in-flight copies, sends their notifications
  notifier_.reset();
  IpcImportCache::Get().Release(this, "");
}

void XgmiBackend::RegisterRemoteEngine(const EngineDesc& desc) {
  std::unique_lock<std::shared_mutex> lock(routesMu_);
  for (auto it = routes_.begin(); it != routes_.end();) it = it->first.engine == desc.key ? routes_.erase(it) : ++it;
}

void XgmiBackend::DeregisterRemoteEngine(const EngineDesc& desc) {
  RegisterRemoteEngine(desc);  // forget its routes first: their mappings are released next
  IpcImportCache::Get().Release(this, desc.key);
  notifier_->Forget(desc.key);
}

void XgmiBackend::DeregisterMemory(const MemoryDesc& desc) {
  std::unique_lock<std::shared_mutex> lock(routesMu_);
  for (auto it = routes_.begin(); it != routes_.end();) it = it->first.local == desc.id ? routes_.erase(it) : ++it;
}

void XgmiBackend::RegisterMemory(MemoryDesc& desc) {
  if (desc.loc != MemoryLocationType::GPU) return;
  try {
    ExportIpc(desc);
  } catch (const std::exception& e) {
    // Still usable through other backends; peers will not route it to XGMI.
    MORI_WARN("XGMI: memory at " << log::Hex(desc.data) << " cannot be shared over IPC ("
                                   << e.what() << "); transfers of it use another backend");
  }
}

int XgmiBackend::LocalOrdinal(const std::string& busId) const {
  if (busId.empty()) return -1;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ordinals_.find(busId);
  if (it != ordinals_.end()) return it->second;
  int dev = -1;
  if (gpuDeviceGetByPCIBusId(&dev, busId.c_str()) != gpuSuccess) {
    (void)gpuGetLastError();
    dev = -1;
  }
  ordinals_[busId] = dev;
  return dev;
}

bool XgmiBackend::PeerCapable(int a, int b) const {
  if (a == b) return true;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peerCapable_.find({a, b});
  if (it != peerCapable_.end()) return it->second;
  int can = 0;
  if (gpuDeviceCanAccessPeer(&can, a, b) != gpuSuccess) {
    (void)gpuGetLastError();
    can = 0;
  }
  peerCapable_[{a, b}] = can != 0;
  return can != 0;
}

void XgmiBackend::EnablePeer(int a, int b) {
  if (a == b) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!peerEnabled_.insert({a, b}).second) return;
  DeviceGuard g(a);
  gpuError_t e = gpuDeviceEnablePeerAccess(b, 0);
  if (e != gpuSuccess && e != gpuErrorPeerAccessAlreadyEnabled)
    MORI_WARN("XGMI: enabling peer access " << a << " -> " << b << " failed: " << gpuGetErrorString(e));
  (void)gpuGetLastError();
}

bool XgmiBackend::CanHandle(const MemoryDesc& local, const MemoryDesc& remote) const {
  EngineDesc target;
  if (!ctx_.remotes.Get(remote.engineKey, &target) || target.nodeId != ctx_.desc.nodeId) return false;
  const bool sameProcess = target.pid == ctx_.desc.pid;
  if (remote.loc == MemoryLocationType::GPU) {
    int ro = LocalOrdinal(remote.deviceBusId);
    if (ro < 0 || (!sameProcess && !remote.HasIpcHandle())) return false;
    if (local.loc == MemoryLocationType::GPU) return PeerCapable(local.deviceId, ro);
    return local.loc == MemoryLocationType::CPU;
  }
  return remote.loc == MemoryLocationType::CPU && sameProcess && local.loc == MemoryLocationType::GPU;
}

bool XgmiBackend::Resolve(const MemoryDesc& local, const MemoryDesc& remote, Route* r, StatusCode* code,
                          std::string* err) {
  EngineDesc target;
  if (!ctx_.remotes.Get(remote.engineKey, &target)) {
    *code = StatusCode::ERR_NOT_FOUND;
    *err = "remote engine '" + remote.engineKey + "' is not registered";
    return false;
  }
  const bool sameProcess = target.pid == ctx_.desc.pid && target.nodeId == ctx_.desc.nodeId;
  r->target = std::make_shared<const EngineDesc>(std::move(target));
  r->localPtr = reinterpret_cast<uint8_t*>(local.data);
  r->kernelOk = local.loc == MemoryLocationType::GPU && remote.loc == MemoryLocationType::GPU;
  if (remote.loc != MemoryLocationType::GPU) {
    r->device = local.deviceId;
    r->remotePtr = reinterpret_cast<uint8_t*>(remote.data);
    return true;
  }
  int ro = LocalOrdinal(remote.deviceBusId);
  r->device = local.loc == MemoryLocationType::GPU ? local.deviceId : ro;
  if (sameProcess) {
    r->remotePtr = reinterpret_cast<uint8_t*>(remote.data);
    if (r->kernelOk) EnablePeer(r->device, ro);
    return true;
  }
  try {
    Mapping m = IpcImportCache::Get().Map(remote, r->device, this);
    if (remote.ipcOffset > m.allocSize || remote.size > m.allocSize - remote.ipcOffset) {
      *code = StatusCode::ERR_INVALID_ARGS;
      *err = "descriptor of memory " + std::to_string(remote.id) + " of engine '" + remote.engineKey +
             "' claims [" + std::to_string(remote.ipcOffset) + ", +" + std::to_string(remote.size) +
             ") but the exported allocation has " + std::to_string(m.allocSize) + " bytes";
      return false;
    }
    r->remotePtr = m.base + remote.ipcOffset;
  } catch (const std::exception& e) {
    *code = StatusCode::ERR_GPU_OP;
    *err = e.what();
    return false;
  }
  return true;
}

bool XgmiBackend::CachedResolve(const MemoryDesc& local, const MemoryDesc& remote, Route* r, StatusCode* code,
                                std::string* err) {
  RouteKey key{local.id, remote.id, remote.engineKey};
  {
    std::shared_lock<std::shared_mutex> lock(routesMu_);
    auto it = routes_.find(key);
    if (it != routes_.end() && it->second.remote == remote && it->second.remote.ipcHandle == remote.ipcHandle &&
        it->second.remote.ipcOffset == remote.ipcOffset) {
      *r = it->second.route;
      return true;
    }
  }
  if (!Resolve(local, remote, r, code, err)) return false;
  try {
    DeviceGuard g(r->device);
    r->resources = &pool_->ForDevice(r->device);
  } catch (const std::exception& e) {
    *code = StatusCode::ERR_GPU_OP;
    *err = std::string("XGMI: GPU resources of device ") + std::to_string(r->device) + ": " + e.what();
    return false;
  }
  std::unique_lock<std::shared_mutex> lock(routesMu_);
  routes_[std::move(key)] = CachedRoute{*r, remote};
  return true;
}

bool XgmiBackend::UseKernel(size_t segments, uint64_t totalBytes) const {
  return segments > 0 && static_cast<int64_t>(segments) >= tuning_.kernelMinSegments &&
         totalBytes / segments <= tuning_.kernelMaxAvgBytes;
}

void XgmiBackend::Launch(std::vector<Job>& jobs, bool isRead) {
  if (jobs.empty()) return;
  const Route& r0 = *jobs.front().route;
  try {
    DeviceGuard g(r0.device);
    StreamPool::Device& dev = Resources(r0);
    size_t nsegs = 0;
    uint64_t totalBytes = 0;
    for (const Job& j : jobs) {
      nsegs += j.segs->size();
      totalBytes += TotalBytes(*j.segs);
    }
    // Calls fn(src, dst, bytes) for every segment of every job.
    auto forEachCopy = [&](auto&& fn) {
      for (const Job& j : jobs) {
        uint8_t* srcBase = isRead ? j.route->remotePtr : j.route->localPtr;
        uint8_t* dstBase = isRead ? j.route->localPtr : j.route->remotePtr;
        for (const Segment& s : *j.segs) {
          const uint64_t so = isRead ? s.remoteOffset : s.localOffset, d = isRead ? s.localOffset : s.remoteOffset;
          fn(srcBase + so, dstBase + d, s.size);
        }
      }
    };
    std::vector<RegionPin> pins;
    pins.reserve(jobs.size());
    for (Job& j : jobs) pins.push_back(std::move(j.pin));
    gpuStream_t stream = dev.NextStream();
    std::shared_ptr<GpuCompletion> c;
    if (r0.kernelOk && UseKernel(nsegs, totalBytes)) {
      SignalSlots::Slot slot = dev.signals.Acquire();
      const KernelSignal signal{slot.counter, slot.device, slot.value};
      std::unique_ptr<SegmentTable> table;
      bool proxied = false;
      try {
        if (nsegs <= kParamSegments) {
          static thread_local std::vector<CopySeg> copies;
          copies.clear();
          forEachCopy([&](uint8_t* src, uint8_t* dst, uint64_t n) {
            copies.push_back({reinterpret_cast<uint64_t>(src), reinterpret_cast<uint64_t>(dst), n});
          });
          profile::Mark(profile::kLaunchBegin);
          // The resident proxy takes it when it fits; otherwise one launch.
          if (dev.proxy) proxied = dev.proxy->Post(copies.data(), copies.size(), totalBytes, signal);
          if (!proxied) LaunchScatterCopy(copies.data(), copies.size(), tuning_.shape, signal, stream);
        } else {
          // Descriptors written straight into the pinned table the launch uploads.
          table = dev.tables.Acquire(nsegs);
          SegmentTable::Entry* e = table->host();
          forEachCopy([&](uint8_t* src, uint8_t* dst, uint64_t n) {
            *e++ = {reinterpret_cast<uint64_t>(src), reinterpret_cast<uint64_t>(dst), n, 0, 0};
          });
          profile::Mark(profile::kLaunchBegin);
          ScatterShape shape = tuning_.shape;
          if (isRead && totalBytes >= XgmiTuning::kLargeReadBytes) shape.pieceBytes = tuning_.largeReadPieceBytes;
          LaunchScatterTable(*table, nsegs, shape, signal, stream);
        }
        profile::Mark(profile::kLaunchEnd);
        profile::SetPath(proxied ? profile::kPathProxy : profile::kPathKernel);
      } catch (...) {
        // Nothing that writes the slot was enqueued. A table whose upload may
        // have been enqueued is freed (a synchronizing free), never reused.
        dev.signals.Release(slot);
        throw;
      }
      c = std::make_shared<GpuCompletion>(pool_, &dev, proxied ? dev.proxy->Stream() : stream, slot, std::move(pins),
                                          proxied ? GpuCompletion::kPersistentStream : false, std::move(table));
    } else {
      static thread_local std::vector<void*> dsts;
      static thread_local std::vector<const void*> srcs;
      static thread_local std::vector<size_t> sizes;
      dsts.clear();
      srcs.clear();
      sizes.clear();
      forEachCopy([&](uint8_t* src, uint8_t* dst, uint64_t n) {
        dsts.push_back(dst);
        srcs.push_back(src);
        sizes.push_back(n);
      });
      profile::Mark(profile::kLaunchBegin);
      const bool batched = EnqueueCopyEngines(dsts, srcs, sizes, stream);
      gpuEvent_t ev = pool_->AcquireEvent(r0.device);
      gpuError_t e = gpuEventRecord(ev, stream);
      if (e != gpuSuccess) pool_->ReleaseEvent(r0.device, ev);
      MORI_GPU_CHECK(e);
      profile::Mark(profile::kLaunchEnd);
      profile::SetPath(batched ? profile::kPathCopyEngineBatch : profile::kPathCopyEngines);
      c = std::make_shared<GpuCompletion>(pool_, r0.device, ev, std::move(pins));
    }
    std::vector<CompletionWaiter::Item> watch;
    watch.reserve(jobs.size());
    for (Job& j : jobs) {
      j.status->SetProgressHook([c](TransferStatus& s) { c->Poll(&s); });
      watch.push_back({c, j.status, config_.enableNotification ? j.route->target : nullptr, j.uid});
    }
    waiter_->WatchAll(std::move(watch));
  } catch (const std::exception& e) {
    for (Job& j : jobs)
      j.status->Update(StatusCode::ERR_GPU_OP, std::string("XGMI copy could not be started: ") + e.what());
  }
}

bool XgmiBackend::EnqueueCopyEngines(const std::vector<void*>& dsts, const std::vector<const void*>& srcs,
                                     const std::vector<size_t>& sizes, gpuStream_t stream) {
#if !defined(MORI_GPU_HIP) && defined(CUDART_VERSION) && CUDART_VERSION >= 13000
  // One call for the whole batch: a cudaMemcpyAsync costs ~3 us of host time, so a
  // request of 32 layers spent ~100 us enqueueing copies the engines then run at the
  // same speed. Copies of a batch may run in any order (segments never overlap).
  if (tuning_.copyEngineBatch && dsts.size() > 1 && copyBatchOk_.load(std::memory_order_relaxed)) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attrIdx = 0;
    const cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr,
                                               &attrIdx, 1, stream);
    if (e == cudaSuccess) return true;
    (void)cudaGetLastError();  // a refused call: nothing was enqueued; copy one by one from now on
    if (copyBatchOk_.exchange(false))
      MORI_WARN("XGMI: cudaMemcpyBatchAsync refused a batch (" << cudaGetErrorString(e)
                                                               << "); copying one cudaMemcpyAsync per segment");
  }
#endif
  for (size_t i = 0; i < dsts.size(); ++i)
    MORI_GPU_CHECK(gpuMemcpyAsync(dsts[i], srcs[i], sizes[i], gpuMemcpyDefault, stream));
  return false;
}

void XgmiBackend::Submit(TransferRequest req) {
  Route r;
  StatusCode code;
  std::string err;
  if (!CachedResolve(*req.local, *req.remote, &r, &code, &err)) {
    req.status->Update(code, err);
    return;
  }
  std::vector<Job> jobs;
  jobs.push_back({&r, &req.segments, req.uid, req.status, std::move(req.localPin)});
  Launch(jobs, req.isRead);
}

void XgmiBackend::SubmitBatch(std::vector<TransferRequest>& reqs) {
  if (reqs.size() == 1) {
    Submit(std::move(reqs.front()));
    return;
  }
  std::vector<Route> routes(reqs.size());
  std::vector<int> devices;  // initiating GPUs of GPU<->GPU pairs, in order of appearance
  std::vector<Job> jobs;
  for (size_t i = 0; i < reqs.size(); ++i) {
    TransferRequest& q = reqs[i];
    StatusCode code;
    std::string err;
    if (!CachedResolve(*q.local, *q.remote, &routes[i], &code, &err)) {
      q.status->Update(code, err);
      q.status.reset();  // handled
      continue;
    }
    if (!routes[i].kernelOk) {  // CPU memory on one side: copy engines, alone
      jobs.clear();
      jobs.push_back({&routes[i], &q.segments, q.uid, q.status, std::move(q.localPin)});
      Launch(jobs, q.isRead);
      q.status.reset();
    } else if (std::find(devices.begin(), devices.end(), routes[i].device) == devices.end()) {
      devices.push_back(routes[i].device);
    }
  }
  // Every GPU pair of one initiating device: one launch (or one proxy post,
  // or copy-engine copies behind one event).
  for (int device : devices) {
    jobs.clear();
    for (size_t i = 0; i < reqs.size(); ++i)
      if (reqs[i].status && routes[i].device == device)
        jobs.push_back({&routes[i], &reqs[i].segments, reqs[i].uid, reqs[i].status, std::move(reqs[i].localPin)});
    Launch(jobs, reqs.front().isRead);
  }
}

std::unique_ptr<BackendSession> XgmiBackend::CreateSession(const MemoryDesc& local, const MemoryDesc& remote) {
  Route r;
  StatusCode code;
  std::string err;
  auto region = ctx_.memory.Find(local.id);
  if (!region || !Resolve(local, remote, &r, &code, &err)) {
    if (!err.empty()) MORI_WARN("XGMI session not created: " << err);
    return nullptr;
  }
  {
    DeviceGuard g(r.device);
    r.resources = &pool_->ForDevice(r.device);  // streams and signal slots: no lookup per transfer
  }
  return std::make_unique<XgmiSession>(*this, std::move(r), std::move(region));
}

}  // namespace mori::io::p2p
