#include "io/engine.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "common/logging.hpp"
#include "io/backend_factory.hpp"
#include "io/net/socket.hpp"
#include "io/notify_channel.hpp"
#include "io/submit_profile.hpp"

namespace mori::io {
namespace {

// deregister_memory: transfers get this long to finish on their own; then the
// sockets still moving the region's bytes are cut and the rest of the bound
// is for threads that cannot be cut (GPU copies, RDMA work requests).
constexpr int64_t kDeregisterGraceMs = 1000;
constexpr int64_t kDeregisterDrainMs = 30000;

// NUMA node of the page holding `ptr` (-1 when unknown or not yet touched).
int NumaNodeOf(uint64_t ptr) {
#ifdef SYS_get_mempolicy
  int node = -1;
  constexpr unsigned long kMpolFNode = 1, kMpolFAddr = 2;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0, reinterpret_cast<void*>(ptr), kMpolFNode | kMpolFAddr) == 0)
    return node;
#endif
  return -1;
}

// Route preference: the fastest transport that can serve a pair wins.
constexpr BackendType kPreference[] = {BackendType::XGMI, BackendType::RDMA, BackendType::TCP};

}  // namespace

// ---------------------------------------------------------------- IOEngine
IOEngine::IOEngine(const std::string& key, const IOEngineConfig& config) {
  if (key.empty()) throw InvalidArgument("IOEngine: key must be a non-empty string");
  if (key.size() > kMaxKeyBytes)
    throw InvalidArgument("IOEngine: key of " + std::to_string(key.size()) + " bytes exceeds " +
                          std::to_string(kMaxKeyBytes));
  ctx_.key = key;
  ctx_.config = config;
  if (ctx_.config.authSecret.empty())
    if (auto s = env::GetString("MORI_IO_AUTH_SECRET")) ctx_.config.authSecret = *s;
  ctx_.desc.key = key;
  ctx_.desc.nodeId = LocalNodeId();
  ctx_.desc.hostname = LocalHostname();
  ctx_.desc.host = config.host.empty() || config.host == "0.0.0.0" ? net::DefaultAdvertiseAddress() : config.host;
  ctx_.desc.port = 0;
  ctx_.desc.pid = static_cast<int32_t>(getpid());
  LocalEngineDirectory::Get().Add(key, &ctx_);
}

IOEngine::~IOEngine() {
  LocalEngineDirectory::Get().Remove(ctx_.key, &ctx_);
  {
    std::lock_guard<std::mutex> lock(ctx_.mu);
    if (ctx_.listener) ctx_.listener->Stop();  // no inbound request touches memory after this
  }
  std::unique_lock<std::shared_mutex> lock(backendsMu_);
  backends_.clear();
}

void IOEngine::CreateBackend(BackendType type, const BackendConfig* config) {
  {
    std::shared_lock<std::shared_mutex> lock(backendsMu_);
    if (backends_.count(type)) {
      MORI_WARN("engine '" << ctx_.key << "': backend " << ToString(type) << " already exists, ignoring");
      return;
    }
  }
  std::unique_ptr<Backend> b = MakeBackend(type, ctx_, config);
  {
    std::unique_lock<std::shared_mutex> lock(backendsMu_);
    if (backends_.count(type)) return;
    backends_[type] = std::move(b);
  }
  InvalidateRoutes();
  if ((type == BackendType::TCP || type == BackendType::RDMA) && AutoXgmiWanted() && !HasBackend(BackendType::XGMI)) {
    try {
      CreateBackend(BackendType::XGMI, nullptr);
      MORI_INFO("engine '" << ctx_.key << "': XGMI backend created automatically for same-node GPU transfers");
    } catch (const std::exception& e) {
      MORI_INFO("engine '" << ctx_.key << "': no automatic XGMI backend (" << e.what() << ")");
    }
  }
}

bool IOEngine::AutoXgmiWanted() const {
  return kBuiltWithGpu && ctx_.config.enableAutoXgmi && !env::GetBool("MORI_IO_DISABLE_AUTO_XGMI", false) &&
         GpuDeviceCount() > 0;
}

void IOEngine::RemoveBackend(BackendType type) {
  std::unique_ptr<Backend> victim;
  {
    std::unique_lock<std::shared_mutex> lock(backendsMu_);
    auto it = backends_.find(type);
    if (it == backends_.end()) return;
    victim = std::move(it->second);
    backends_.erase(it);
  }
  InvalidateRoutes();
}

bool IOEngine::HasBackend(BackendType type) const {
  std::shared_lock<std::shared_mutex> lock(backendsMu_);
  return backends_.count(type) != 0;
}

std::vector<BackendType> IOEngine::Backends() const {
  std::shared_lock<std::shared_mutex> lock(backendsMu_);
  std::vector<BackendType> out;
  for (const auto& [t, b] : backends_) out.push_back(t);
  return out;
}

void IOEngine::RegisterRemoteEngine(const EngineDesc& desc) {
  if (desc.key.empty()) throw InvalidArgument("register_remote_engine: the descriptor has an empty key");
  ctx_.remotes.Put(desc);
  std::shared_lock<std::shared_mutex> lock(backendsMu_);
  for (auto& [t, b] : backends_) b->RegisterRemoteEngine(desc);
  lock.unlock();
  InvalidateRoutes();
}

void IOEngine::DeregisterRemoteEngine(const EngineDesc& desc) {
  ctx_.remotes.Erase(desc.key);
  std::shared_lock<std::shared_mutex> lock(backendsMu_);
  for (auto& [t, b] : backends_) b->DeregisterRemoteEngine(desc);
  lock.unlock();
  InvalidateRoutes();
}

MemoryDesc IOEngine::RegisterMemory(uint64_t ptr, uint64_t size, int deviceId, MemoryLocationType loc) {
  if (ptr == 0) throw InvalidArgument("register_memory: ptr must be non-zero");
  if (size == 0) throw InvalidArgument("register_memory: size must be > 0");
  if (ptr + size < ptr) throw InvalidArgument("register_memory: ptr + size overflows the address space");
  MemoryDesc d;
  d.engineKey = ctx_.key;
  d.data = ptr;
  d.size = size;
  d.loc = loc;
  if (loc == MemoryLocationType::GPU) {
    if (!kBuiltWithGpu)
      throw BadState("register_memory: GPU memory needs a CUDA/HIP build of mori_core (this build is CPU-only)");
    int n = GpuDeviceCount();
    if (deviceId < 0 || deviceId >= n)
      throw InvalidArgument("register_memory: device_id=" + std::to_string(deviceId) + " is not a visible GPU (" +
                            std::to_string(n) + " visible)");
    d.deviceId = deviceId;
#if MORI_WITH_GPU
    d.deviceBusId = GpuPciBusId(deviceId);
#endif
  } else if (loc == MemoryLocationType::CPU) {
    d.deviceId = -1;
    d.numaNode = NumaNodeOf(ptr);
  } else {
    throw InvalidArgument("register_memory: mem_loc must be MemoryLocationType.CPU or GPU");
  }
  d.id = ctx_.memory.NextId();
  {
    std::shared_lock<std::shared_mutex> lock(backendsMu_);
    for (auto& [t, b] : backends_) b->RegisterMemory(d);
  }
  ctx_.memory.Add(d);
  return d;
}

void IOEngine::DeregisterMemory(const MemoryDesc& desc) {
  if (desc.engineKey != ctx_.key)
    throw InvalidArgument("deregister_memory: memory belongs to engine '" + desc.engineKey + "', not '" + ctx_.key +
                          "'");
  auto region = ctx_.memory.Remove(desc.id);
  if (!region) return;  // already deregistered: idempotent
  size_t cut = 0;
  if (!region->RevokeAndDrain(kDeregisterGraceMs, kDeregisterDrainMs - kDeregisterGraceMs, &cut))
    MORI_ERROR("deregister_memory: transfers on memory " << desc.id << " did not finish within "
                                                         << kDeregisterDrainMs << " ms");
  else if (cut > 0)
    MORI_WARN("deregister_memory: memory " << desc.id << " was still in use after " << kDeregisterGraceMs
                                           << " ms; cut " << cut << " connection(s) moving its bytes");
  {
    std::shared_lock<std::shared_mutex> lock(backendsMu_);
    for (auto& [t, b] : backends_) b->DeregisterMemory(region->desc);
  }
  InvalidateRoutes();
}

void IOEngine::InvalidateRoutes() {
  std::unique_lock<std::shared_mutex> lock(routesMu_);
  routes_.clear();
}

IOEngine::Route IOEngine::Resolve(const MemoryDesc& local, const MemoryDesc& remote) {
  Route r;
  if (local.engineKey != ctx_.key) {
    r.code = StatusCode::ERR_INVALID_ARGS;
    r.error = "local memory belongs to engine '" + local.engineKey + "', not to this engine '" + ctx_.key + "'";
    return r;
  }
  r.region = ctx_.memory.Find(local.id);
  if (!r.region) {
    r.code = StatusCode::ERR_NOT_FOUND;
    r.error = "local memory " + std::to_string(local.id) + " is not registered (deregistered?)";
    return r;
  }
  {
    std::shared_lock<std::shared_mutex> lock(routesMu_);
    auto it = routes_.find(std::forward_as_tuple(remote.engineKey, local.id, remote.id));
    if (it != routes_.end()) {
      r.backend = it->second;
      return r;
    }
  }
  EngineDesc remoteEngine;
  if (!ctx_.remotes.Get(remote.engineKey, &remoteEngine)) {
    r.code = StatusCode::ERR_NOT_FOUND;
    r.error = "remote engine '" + remote.engineKey + "' is not registered (call register_remote_engine first)";
    return r;
  }
  for (BackendType t : kPreference) {
    auto it = backends_.find(t);
    if (it != backends_.end() && it->second->CanHandle(r.region->desc, remote)) {
      r.backend = it->second.get();
      break;
    }
  }
  if (!r.backend) {
    std::string msg = std::string("no available backend for ") + ToString(local.loc) + " -> " + ToString(remote.loc) +
                      " memory between '" + ctx_.key + "' and '" + remote.engineKey + "' (backends:";
    for (const auto& [t, b] : backends_) msg += std::string(" ") + ToString(t);
    if (backends_.empty()) msg += " none; call create_backend first";
    r.code = StatusCode::ERR_BAD_STATE;
    r.error = msg + ")";
    return r;
  }
  std::unique_lock<std::shared_mutex> wlock(routesMu_);
  routes_[RouteKey{remote.engineKey, local.id, remote.id}] = r.backend;
  return r;
}

BackendType IOEngine::RouteOf(const MemoryDesc& local, const MemoryDesc& remote, std::string* why) {
  std::shared_lock<std::shared_mutex> lock(backendsMu_);
  Route r = Resolve(local, remote);
  if (!r.backend) {
    if (why) *why = r.error;
    return BackendType::Unknown;
  }
  return r.backend->Type();
}

StatusPtr IOEngine::Finished(StatusCode code, const std::string& message) {
  auto s = std::make_shared<TransferStatus>();
  s->Update(code, message);
  return s;
}

StatusPtr IOEngine::Prepare(const MemoryDesc& local, const MemoryDesc& remote, SegmentList segs, TransferUniqueId uid,
                            bool isRead, Backend** backend, TransferRequest* req) {
  *backend = nullptr;
  Route route = Resolve(local, remote);
  if (!route.backend) return Finished(route.code, route.error);
  const auto& region = route.region;
  RegionPin pin(region);
  if (!pin) return Finished(StatusCode::ERR_NOT_FOUND, "local memory " + std::to_string(local.id) + " was deregistered");
  std::string bad = CheckAndMerge(&segs, region->desc.size, remote.size);
  if (!bad.empty()) return Finished(StatusCode::ERR_INVALID_ARGS, bad);
  if (segs.empty()) return Finished(StatusCode::SUCCESS, "");
  auto status = std::make_shared<TransferStatus>();
  status->Update(StatusCode::IN_PROGRESS);
  *backend = route.backend;
  *req = TransferRequest{&region->desc, &remote, std::move(segs), uid, isRead, status, std::move(pin)};
  return status;
}

StatusPtr IOEngine::Submit(const MemoryDesc& local, const MemoryDesc& remote, SegmentList segs, TransferUniqueId uid,
                           bool isRead) {
  // Held until the backend has the work: a backend is never removed under a submission.
  std::shared_lock<std::shared_mutex> backendsLock(backendsMu_);
  Backend* backend = nullptr;
  TransferRequest req{};
  StatusPtr status = Prepare(local, remote, std::move(segs), uid, isRead, &backend, &req);
  if (!backend) return status;
  profile::Mark(profile::kValidated);
  backend->Submit(std::move(req));
  profile::Mark(profile::kSubmitted);
  return status;
}

StatusPtr IOEngine::Read(const MemoryDesc& local, uint64_t localOffset, const MemoryDesc& remote,
                         uint64_t remoteOffset, uint64_t size, TransferUniqueId uid) {
  return Submit(local, remote, SegmentList{{localOffset, remoteOffset, size}}, uid, true);
}

StatusPtr IOEngine::Write(const MemoryDesc& local, uint64_t localOffset, const MemoryDesc& remote,
                          uint64_t remoteOffset, uint64_t size, TransferUniqueId uid) {
  return Submit(local, remote, SegmentList{{localOffset, remoteOffset, size}}, uid, false);
}

std::vector<StatusPtr> IOEngine::BatchReadWrite(const std::vector<const MemoryDesc*>& locals,
                                                const std::vector<std::vector<uint64_t>>& localOffsets,
                                                const std::vector<const MemoryDesc*>& remotes,
                                                const std::vector<std::vector<uint64_t>>& remoteOffsets,
                                                const std::vector<std::vector<uint64_t>>& sizes,
                                                const std::vector<TransferUniqueId>& uids, bool isRead) {
  const size_t n = locals.size();
  if (remotes.size() != n || localOffsets.size() != n || remoteOffsets.size() != n || sizes.size() != n ||
      uids.size() != n)
    throw InvalidArgument("batch transfer: local_mems, local_offsets, remote_mems, remote_offsets, sizes and "
                          "transfer_uids must have the same length (one entry per memory pair)");
  std::vector<StatusPtr> out;
  out.reserve(n);
  // Every pair is validated first; then each backend gets its pairs in one
  // call (XGMI moves all of a device's GPU pairs with one launch).
  std::shared_lock<std::shared_mutex> backendsLock(backendsMu_);
  std::vector<std::pair<Backend*, std::vector<TransferRequest>>> groups;
  for (size_t i = 0; i < n; ++i) {
    SegmentList segs;
    try {
      segs = MakeSegments(localOffsets[i], remoteOffsets[i], sizes[i]);
    } catch (const InvalidArgument& e) {
      out.push_back(Finished(StatusCode::ERR_INVALID_ARGS, "pair " + std::to_string(i) + ": " + e.what()));
      continue;
    }
    Backend* backend = nullptr;
    TransferRequest req{};
    out.push_back(Prepare(*locals[i], *remotes[i], std::move(segs), uids[i], isRead, &backend, &req));
    if (!backend) continue;
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == backend; });
    if (g == groups.end()) {
      groups.emplace_back(backend, std::vector<TransferRequest>{});
      g = groups.end() - 1;
    }
    g->second.push_back(std::move(req));
  }
  profile::Mark(profile::kValidated);
  for (auto& [backend, reqs] : groups) backend->SubmitBatch(reqs);
  profile::Mark(profile::kSubmitted);
  return out;
}

std::unique_ptr<IOEngineSession> IOEngine::CreateSession(const MemoryDesc& local, const MemoryDesc& remote,
                                                         std::string* why) {
  std::shared_lock<std::shared_mutex> lock(backendsMu_);
  Route route = Resolve(local, remote);
  if (!route.backend) {
    if (why) *why = route.error;
    return nullptr;
  }
  const auto& region = route.region;
  std::unique_ptr<BackendSession> s = route.backend->CreateSession(region->desc, remote);
  if (!s) {
    if (why) *why = std::string("backend ") + ToString(route.backend->Type()) + " could not build a session";
    return nullptr;
  }
  return std::make_unique<IOEngineSession>(*this, std::move(s), region->desc, remote);
}

bool IOEngine::PopInboundTransferStatus(const std::string& remoteKey, TransferUniqueId uid) {
  return ctx_.notifications.Pop(remoteKey, uid);
}

// --------------------------------------------------------- IOEngineSession
IOEngineSession::IOEngineSession(IOEngine& engine, std::unique_ptr<BackendSession> session, MemoryDesc local,
                                 MemoryDesc remote)
    : engine_(engine), session_(std::move(session)), local_(std::move(local)), remote_(std::move(remote)) {}

TransferUniqueId IOEngineSession::AllocateTransferUniqueId() { return engine_.AllocateTransferUniqueId(); }

StatusPtr IOEngineSession::Submit(SegmentList segs, TransferUniqueId uid, bool isRead) {
  std::string bad = CheckAndMerge(&segs, local_.size, remote_.size);
  if (!bad.empty()) return IOEngine::Finished(StatusCode::ERR_INVALID_ARGS, bad);
  if (segs.empty()) return IOEngine::Finished(StatusCode::SUCCESS, "");
  auto status = std::make_shared<TransferStatus>();
  status->Update(StatusCode::IN_PROGRESS);
  profile::Mark(profile::kValidated);
  session_->Submit(std::move(segs), uid, isRead, status);
  profile::Mark(profile::kSubmitted);
  return status;
}

StatusPtr IOEngineSession::Read(uint64_t localOffset, uint64_t remoteOffset, uint64_t size, TransferUniqueId uid) {
  return Submit(SegmentList{{localOffset, remoteOffset, size}}, uid, true);
}

StatusPtr IOEngineSession::Write(uint64_t localOffset, uint64_t remoteOffset, uint64_t size, TransferUniqueId uid) {
  return Submit(SegmentList{{localOffset, remoteOffset, size}}, uid, false);
}

StatusPtr IOEngineSession::BatchReadWrite(const std::vector<uint64_t>& localOffsets,
                                          const std::vector<uint64_t>& remoteOffsets,
                                          const std::vector<uint64_t>& sizes, TransferUniqueId uid, bool isRead) {
  SegmentList segs;
  try {
    segs = MakeSegments(localOffsets, remoteOffsets, sizes);
  } catch (const InvalidArgument& e) {
    return IOEngine::Finished(StatusCode::ERR_INVALID_ARGS, e.what());
  }
  return Submit(std::move(segs), uid, isRead);
}

bool IOEngineSession::Alive() const { return session_->Alive(); }

}  // namespace mori::io
