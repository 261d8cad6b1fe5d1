#include "io/tcp/tcp_backend.hpp"

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "common/logging.hpp"
#include "io/tcp/inbound.hpp"
#include "io/tcp/wire.hpp"

namespace mori::io::tcp {
namespace {

void ValidateConfig(const TcpBackendConfig& c) {
  if (c.numConnections < 1 || c.numConnections > 64)
    throw InvalidArgument("TcpBackendConfig.num_connections=" + std::to_string(c.numConnections) +
                          " must be in [1, 64]");
  if (c.chunkBytes < 4096 || c.chunkBytes > kMaxFrameBytes)
    throw InvalidArgument("TcpBackendConfig.chunk_bytes=" + std::to_string(c.chunkBytes) + " must be in [4096, " +
                          std::to_string(kMaxFrameBytes) + "]");
  if (c.opTimeoutMs < 100)
    throw InvalidArgument("TcpBackendConfig.op_timeout_ms=" + std::to_string(c.opTimeoutMs) + " must be >= 100");
  if (c.connectTimeoutMs < 10)
    throw InvalidArgument("TcpBackendConfig.connect_timeout_ms=" + std::to_string(c.connectTimeoutMs) +
                          " must be >= 10");
  if (c.heartbeatTimeoutMs != 0 && c.heartbeatTimeoutMs < 100)
    throw InvalidArgument("TcpBackendConfig.heartbeat_timeout_ms=" + std::to_string(c.heartbeatTimeoutMs) +
                          " must be 0 (off) or >= 100");
  if (c.stagingBytes < (128u << 10))
    throw InvalidArgument("TcpBackendConfig.staging_bytes=" + std::to_string(c.stagingBytes) + " must be >= 131072");
}

bool LocationSupported(MemoryLocationType loc) {
  return loc == MemoryLocationType::CPU || (loc == MemoryLocationType::GPU && kBuiltWithGpu);
}

class TcpSession : public BackendSession {
 public:
  TcpSession(std::shared_ptr<PeerLink> link, MemoryDesc local, std::shared_ptr<LocalRegion> region,
             MemoryDesc remote)
      : link_(std::move(link)), local_(std::move(local)), region_(std::move(region)), remote_(std::move(remote)) {}

  void Submit(SegmentList segments, TransferUniqueId uid, bool isRead, const StatusPtr& status) override {
    RegionPin pin(region_);
    if (!pin) {
      status->Update(StatusCode::ERR_NOT_FOUND, "local memory " + std::to_string(local_.id) + " was deregistered");
      return;
    }
    link_->Submit(TcpBackend::NewTransfer(local_, std::move(pin), status), remote_.id, segments, uid, isRead);
  }
  bool Alive() const override { return link_->Alive(); }

 private:
  std::shared_ptr<PeerLink> link_;
  MemoryDesc local_;
  std::shared_ptr<LocalRegion> region_;
  MemoryDesc remote_;
};

}  // namespace

TcpBackend::TcpBackend(EngineContext& ctx, const TcpBackendConfig& config) : ctx_(ctx), config_(config) {
  ValidateConfig(config_);
  net::Listener& l = ctx_.EnsureListener();
  // The handler captures only engine-lifetime state and a copy of the
  // config, so inbound connections outlive a removed backend safely.
  EngineContext* c = &ctx_;
  TcpBackendConfig cfg = config_;
  l.SetHandler(net::Channel::TcpData, [c, cfg](net::Socket& s, const net::PeerHello& p) {
    return NewDataChannelSession(*c, cfg, s, p);
  });
  MORI_INFO("TCP backend ready on engine '" << ctx_.key << "' port " << l.port() << " (" << config_.numConnections
                                            << " sockets per peer)");
}

TcpBackend::~TcpBackend() {
  {
    std::lock_guard<std::mutex> lock(ctx_.mu);
    if (ctx_.listener) ctx_.listener->SetHandler(net::Channel::TcpData, nullptr);
  }
  std::unordered_map<std::string, std::shared_ptr<PeerLink>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    links.swap(links_);
  }
  for (auto& [k, l] : links) l->Close();
}

void TcpBackend::RegisterRemoteEngine(const EngineDesc& desc) {
  // A re-registered engine (e.g. restarted on another port) gets a fresh link.
  std::shared_ptr<PeerLink> old;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(desc.key);
  if (it != links_.end() && !(it->second->remote() == desc)) {
    old = std::move(it->second);
    links_.erase(it);
  }
}

void TcpBackend::DeregisterRemoteEngine(const EngineDesc& desc) {
  std::shared_ptr<PeerLink> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(desc.key);
    if (it == links_.end()) return;
    old = std::move(it->second);
    links_.erase(it);
  }
  old->Close();
}

bool TcpBackend::CanHandle(const MemoryDesc& local, const MemoryDesc& remote) const {
  if (!LocationSupported(local.loc) || !LocationSupported(remote.loc)) return false;
  EngineDesc d;
  return ctx_.remotes.Get(remote.engineKey, &d) && d.port != 0 && !d.host.empty();
}

std::shared_ptr<PeerLink> TcpBackend::LinkFor(const std::string& remoteKey, std::string* err) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(remoteKey);
  if (it != links_.end()) return it->second;
  EngineDesc d;
  if (!ctx_.remotes.Get(remoteKey, &d)) {
    *err = "remote engine '" + remoteKey + "' is not registered";
    return nullptr;
  }
  auto link = std::make_shared<PeerLink>(LinkTarget{d, ctx_.Handshake(), config_});
  links_[remoteKey] = link;
  return link;
}

std::shared_ptr<TcpTransfer> TcpBackend::NewTransfer(const MemoryDesc& local, RegionPin pin, StatusPtr status) {
  auto x = std::make_shared<TcpTransfer>();
  x->status = std::move(status);
  x->localPin = std::move(pin);
  x->localBase = reinterpret_cast<uint8_t*>(local.data);
  x->localLoc = local.loc;
  x->localDevice = local.deviceId;
  return x;
}

void TcpBackend::Submit(TransferRequest req) {
  std::string err;
  auto link = LinkFor(req.remote->engineKey, &err);
  if (!link) {
    req.status->Update(StatusCode::ERR_NOT_FOUND, err);
    return;
  }
  link->Submit(NewTransfer(*req.local, std::move(req.localPin), req.status), req.remote->id, req.segments, req.uid,
               req.isRead);
}

std::unique_ptr<BackendSession> TcpBackend::CreateSession(const MemoryDesc& local, const MemoryDesc& remote) {
  std::string err;
  auto link = LinkFor(remote.engineKey, &err);
  auto region = ctx_.memory.Find(local.id);
  if (!link || !region) return nullptr;
  return std::make_unique<TcpSession>(std::move(link), local, std::move(region), remote);
}

}  // namespace mori::io::tcp
