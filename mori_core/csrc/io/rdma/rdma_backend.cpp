#include "io/rdma/rdma_backend.hpp"

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "common/logging.hpp"
#include "io/rdma/control_server.hpp"
#include "io/rdma/rdma_core.hpp"
#include "io/rdma/verbs_api.hpp"

namespace mori::io::rdma {
namespace {

constexpr const char* kFallbackHint =
    " — BackendType.TCP works on any machine (create it as well, or instead: the engine routes to TCP when no RDMA "
    "backend exists)";

bool LocationSupported(MemoryLocationType loc) {
  return loc == MemoryLocationType::CPU || (loc == MemoryLocationType::GPU && kBuiltWithGpu);
}

class RdmaSession : public BackendSession {
 public:
  RdmaSession(std::shared_ptr<RdmaCore> core, std::shared_ptr<LocalRegion> region, MemoryDesc remote, Route route)
      : core_(std::move(core)), region_(std::move(region)), remote_(std::move(remote)), route_(std::move(route)) {}

  void Submit(SegmentList segments, TransferUniqueId uid, bool isRead, const StatusPtr& status) override {
    RegionPin pin(region_);
    if (!pin) {
      status->Update(StatusCode::ERR_NOT_FOUND, "local memory " + std::to_string(region_->desc.id) +
                                                    " was deregistered");
      return;
    }
    Route r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The cached route (rkey, QPs) is reused until its connection failed;
      // then it is rebuilt here, on the next transfer.
      if (!route_.group->Healthy() || route_.peer->Closed()) {
        StatusCode code;
        std::string err;
        Route fresh;
        if (!core_->Resolve(region_->desc, remote_, &fresh, &code, &err)) {
          status->Update(code, err);
          return;
        }
        route_ = std::move(fresh);
      }
      r = route_;
    }
    core_->Post(r, segments, uid, isRead, status, std::move(pin));
  }

  bool Alive() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return !core_->Closed() && !route_.peer->Closed();
  }

 private:
  std::shared_ptr<RdmaCore> core_;
  std::shared_ptr<LocalRegion> region_;
  MemoryDesc remote_;
  mutable std::mutex mu_;
  Route route_;
};

}  // namespace

RdmaBackend::RdmaBackend(EngineContext& ctx, const RdmaBackendConfig& config) : ctx_(ctx) {
  RdmaSettings settings = ResolveSettings(config);  // InvalidArgument -> ValueError
  const VerbsApi* verbs = Verbs();
  if (!verbs) throw BadState("create_backend(RDMA): " + VerbsLoadError() + kFallbackHint);
  std::vector<NicPtr> nics;
  try {
    nics = OpenNics(*verbs, settings);
  } catch (const InvalidArgument&) {
    throw;
  } catch (const std::exception& e) {
    throw BadState(std::string("create_backend(RDMA): ") + e.what() + kFallbackHint);
  }
  core_ = std::make_shared<RdmaCore>(ctx_, std::move(settings), *verbs, std::move(nics));
  net::Listener& l = ctx_.EnsureListener();
  std::shared_ptr<RdmaCore> core = core_;
  l.SetHandler(net::Channel::RdmaControl,
               [core](net::Socket& s, const net::PeerHello& p) { return NewControlSession(core, s, p); });
  MORI_INFO("RDMA backend ready on engine '" << ctx_.key << "' (" << core_->nics().size() << " port(s), "
                                             << core_->settings.config.qpPerTransfer << " QP(s) per transfer)");
}

RdmaBackend::~RdmaBackend() {
  {
    std::lock_guard<std::mutex> lock(ctx_.mu);
    if (ctx_.listener) ctx_.listener->SetHandler(net::Channel::RdmaControl, nullptr);
  }
  core_->Shutdown();
}

void RdmaBackend::RegisterRemoteEngine(const EngineDesc& desc) { core_->UpdatePeer(desc); }

void RdmaBackend::DeregisterRemoteEngine(const EngineDesc& desc) { core_->ForgetPeer(desc.key); }

void RdmaBackend::DeregisterMemory(const MemoryDesc& desc) { core_->DropMemory(desc.id); }

bool RdmaBackend::CanHandle(const MemoryDesc& local, const MemoryDesc& remote) const {
  if (core_->Closed() || !LocationSupported(local.loc) || !LocationSupported(remote.loc)) return false;
  EngineDesc d;
  if (!ctx_.remotes.Get(remote.engineKey, &d) || d.port == 0 || d.host.empty()) return false;
  auto peer = core_->Peer(remote.engineKey);
  std::string why;
  // Asks the peer once whether it serves RDMA, so an engine without an RDMA
  // backend (or without a compatible NIC) is reached over TCP instead.
  return peer && peer->Probe(&why);
}

void RdmaBackend::Submit(TransferRequest req) {
  Route route;
  StatusCode code;
  std::string err;
  if (!core_->Resolve(*req.local, *req.remote, &route, &code, &err)) {
    req.status->Update(code, err);
    return;
  }
  core_->Post(route, req.segments, req.uid, req.isRead, req.status, std::move(req.localPin));
}

std::unique_ptr<BackendSession> RdmaBackend::CreateSession(const MemoryDesc& local, const MemoryDesc& remote) {
  auto region = ctx_.memory.Find(local.id);
  RegionPin pin(region);  // no registration may race a deregistration
  if (!pin) return nullptr;
  Route route;
  StatusCode code;
  std::string err;
  // Eager: QPs connected and the rkey fetched now, so the first transfer is fast.
  if (!core_->Resolve(region->desc, remote, &route, &code, &err)) {
    MORI_WARN("RDMA: cannot create a session to engine '" << remote.engineKey << "': " << err);
    return nullptr;
  }
  return std::make_unique<RdmaSession>(core_, std::move(region), remote, std::move(route));
}

}  // namespace mori::io::rdma
