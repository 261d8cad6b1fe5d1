#include "io/rdma/peer_link.hpp"

#include "common/error.hpp"
#include "common/logging.hpp"
#include "io/net/control_plane.hpp"
#include "io/rdma/control_protocol.hpp"
#include "io/rdma/rdma_core.hpp"

namespace mori::io::rdma {
namespace {

constexpr int64_t kProbeRetryMs = 5000;

}  // namespace

PeerLink::PeerLink(RdmaCore& core, EngineDesc desc)
    : core_(core), desc_(std::move(desc)), where_("engine '" + desc_.key + "' (" + desc_.host + ":" +
                                                   std::to_string(desc_.port) + ")") {}

PeerLink::~PeerLink() { Close(); }

void PeerLink::Close() {
  closed_ = true;
  std::map<std::string, GroupPtr> groups;
  {
    std::lock_guard<std::mutex> lock(mu_);
    groups.swap(groups_);
    memory_.clear();
  }
  // Closing the control connection makes the peer free its side of every group.
  std::lock_guard<std::mutex> lock(callMu_);
  sock_.Close();
}

bool PeerLink::CallLocked(const std::vector<uint8_t>& request, std::vector<uint8_t>* reply, std::string* err) {
  const int64_t t = core_.settings.controlTimeoutMs;
  if (!sock_.valid()) {
    try {
      net::SessionKeys keys;
      sock_ = net::Dial(desc_.host, desc_.port, net::Channel::RdmaControl, core_.ctx.Handshake(), desc_.key, t, &keys);
      txMac_ = keys.ForSending(true);
      rxMac_ = keys.ForReceiving(true);
      calls_ = 0;
    } catch (const std::exception& e) {
      *err = "RDMA control connection to " + where_ + " failed: " + e.what();
      return false;
    }
    generation_.fetch_add(1);
  }
  std::string e;
  bool ok = net::SendAuthedMsg(sock_, txMac_, calls_, request.data(), static_cast<uint32_t>(request.size()), t, &e) &&
            net::RecvAuthedMsg(sock_, rxMac_, calls_, reply, kMaxControlBytes, t, &e);
  ++calls_;
  if (!ok) {
    sock_.Close();
    if (e == "connection closed by peer")
      e += " (does it have an RDMA backend? create_backend(BackendType.RDMA) on both engines)";
    *err = "RDMA control request to " + where_ + " failed: " + e + " (MORI_IO_CP_TIMEOUT_MS=" + std::to_string(t) + ")";
  }
  return ok;
}

bool PeerLink::Call(const std::vector<uint8_t>& request, std::vector<uint8_t>* reply, std::string* err) {
  if (closed_) {
    *err = where_ + " was deregistered";
    return false;
  }
  std::vector<uint64_t> releases;
  {
    std::lock_guard<std::mutex> lock(mu_);
    releases.swap(releases_);
  }
  std::lock_guard<std::mutex> lock(callMu_);
  if (!releases.empty() && sock_.valid()) {
    // Groups we dropped since the last request; best effort (a closed
    // connection frees them on the peer anyway).
    ReleaseRequest rel;
    rel.groupIds = std::move(releases);
    std::vector<uint8_t> ack;
    std::string e;
    if (CallLocked(Encode(rel), &ack, &e)) {
      try {
        DecodeReleased(ack);
      } catch (const std::exception& ex) {
        MORI_WARN("RDMA: bad Release reply from " << where_ << ": " << ex.what());
      }
    }
  }
  return CallLocked(request, reply, err);
}

void PeerLink::QueueRelease(uint64_t groupId) {
  std::lock_guard<std::mutex> lock(mu_);
  if (releases_.size() < kMaxReleasePerMessage) releases_.push_back(groupId);
}

bool PeerLink::Probe(std::string* err) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (probeState_ == 1) return true;
    if (probeState_ == -1 && SteadyNowMs() - probeAtMs_ < kProbeRetryMs) {
      *err = probeError_;
      return false;
    }
  }
  std::vector<uint8_t> reply;
  std::string e;
  bool ok = Call(Encode(HelloRequest{}), &reply, &e);
  if (ok) {
    try {
      HelloReply h = DecodeHelloReply(reply);
      if ((h.linkLayerMask & core_.LinkLayerMask()) == 0) {
        e = where_ + " has no RDMA port with a link layer of ours (InfiniBand vs RoCE)";
        ok = false;
      }
    } catch (const std::exception& ex) {
      e = std::string("bad Hello reply from ") + where_ + ": " + ex.what();
      ok = false;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  probeState_ = ok ? 1 : -1;
  probeAtMs_ = SteadyNowMs();
  probeError_ = e;
  if (!ok) {
    *err = e;
    MORI_INFO("RDMA: not routing to " << where_ << ": " << e);
  }
  return ok;
}

bool PeerLink::Memory(const MemoryDesc& remote, RemoteMemory* out, StatusCode* code, std::string* err) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = memory_.find(remote.id);
    if (it != memory_.end()) {
      *out = it->second;
      return true;
    }
  }
  std::vector<uint8_t> reply;
  if (!Call(Encode(GetMemoryRequest{remote.id}), &reply, err)) {
    *code = StatusCode::ERR_BAD_STATE;
    return false;
  }
  MemoryInfoReply m;
  try {
    m = DecodeMemoryInfo(reply);
  } catch (const std::exception& e) {
    *code = StatusCode::ERR_BAD_STATE;
    *err = std::string("bad memory reply from ") + where_ + ": " + e.what();
    return false;
  }
  if (m.code != StatusCode::SUCCESS) {
    *code = m.code;
    *err = where_ + ": " + m.message;
    return false;
  }
  if (m.addr != remote.data || m.size != remote.size) {
    *code = StatusCode::ERR_INVALID_ARGS;
    *err = "memory " + std::to_string(remote.id) + " of " + where_ + " is [" + std::to_string(m.addr) + ", +" +
           std::to_string(m.size) + ") but the MemoryDesc says [" + std::to_string(remote.data) + ", +" +
           std::to_string(remote.size) + ") (stale descriptor?)";
    return false;
  }
  RemoteMemory r{m.nic, m.addr, m.size, m.rkey};
  std::lock_guard<std::mutex> lock(mu_);
  memory_[remote.id] = r;
  *out = r;
  return true;
}

void PeerLink::ForgetMemory() {
  std::lock_guard<std::mutex> lock(mu_);
  memory_.clear();
}

GroupPtr PeerLink::Group(const NicPtr& nic, const std::string& remoteNic, bool* rebuilt, std::string* err) {
  *rebuilt = false;
  const std::string key = nic->Id() + "|" + remoteNic;
  auto usable = [&](const GroupPtr& g) { return g && g->Healthy() && g->controlGeneration == generation_.load(); };
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(key);
    if (it != groups_.end() && usable(it->second)) return it->second;
  }
  std::lock_guard<std::mutex> connect(connectMu_);
  GroupPtr stale;  // destroyed outside mu_: its release hook takes mu_
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(key);
    if (it != groups_.end()) {
      if (usable(it->second)) return it->second;
      MORI_INFO("RDMA: rebuilding the connection to " << where_ << " on " << nic->Id() << ": "
                                                      << (it->second->Healthy() ? "control connection was reset"
                                                                                : it->second->FirstFailure()));
      stale = std::move(it->second);
      groups_.erase(it);
      *rebuilt = true;
      memory_.clear();  // rkeys may be stale as well
    }
  }
  stale.reset();
  if (closed_) {
    *err = where_ + " was deregistered";
    return nullptr;
  }
  auto g = std::make_shared<QpGroup>();
  g->id = core_.NextGroupId();
  g->nic = nic;
  g->remoteNic = remoteNic;
  g->poller = core_.poller();
  ConnectRequest req;
  req.groupId = g->id;
  req.targetNic = remoteNic;
  req.initiator = nic->Address();
  try {
    for (int i = 0; i < core_.settings.config.qpPerTransfer; ++i) {
      g->qps.push_back(std::make_shared<QueuePair>(nic, QueuePair::Role::Initiator, core_.settings, desc_.key,
                                                   nullptr, core_.NextQpSerial()));
      req.qps.push_back(g->qps.back()->Address());
    }
  } catch (const std::exception& e) {
    *err = std::string("cannot create queue pairs to ") + where_ + ": " + e.what();
    return nullptr;
  }
  std::vector<uint8_t> reply;
  if (!Call(Encode(req), &reply, err)) return nullptr;
  g->controlGeneration = generation_.load();
  std::weak_ptr<PeerLink> self = weak_from_this();
  g->onRelease = [self](uint64_t id) {
    if (auto p = self.lock()) p->QueueRelease(id);
  };
  try {
    ConnectedReply c = DecodeConnected(reply);
    if (c.code != StatusCode::SUCCESS) {
      *err = where_ + " refused the RDMA connection: " + c.message;
      return nullptr;
    }
    if (c.qps.size() != g->qps.size())
      throw BadState("peer answered with " + std::to_string(c.qps.size()) + " queue pairs, expected " +
                     std::to_string(g->qps.size()));
    g->remoteMaxMsg = c.target.maxMsgSize;
    for (size_t i = 0; i < g->qps.size(); ++i) g->qps[i]->Connect(c.target, c.qps[i]);
  } catch (const std::exception& e) {
    *err = std::string("connecting queue pairs to ") + where_ + " failed: " + e.what();
    return nullptr;
  }
  if (auto p = core_.poller())
    for (const auto& q : g->qps) p->Add(q);
  MORI_INFO("RDMA: connected " << g->qps.size() << " queue pair(s) " << nic->Id() << " -> " << where_ << " "
                               << remoteNic);
  std::lock_guard<std::mutex> lock(mu_);
  groups_[key] = g;
  return g;
}

}  // namespace mori::io::rdma
