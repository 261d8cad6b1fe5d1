#include "io/rdma/rdma_core.hpp"

#include <algorithm>

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "common/logging.hpp"
#include "io/rdma/pci_topology.hpp"
#include "io/rdma/post_planner.hpp"

namespace mori::io::rdma {

using namespace abi;

namespace {

constexpr size_t kMaxGroupsPerConnection = 256;

}  // namespace

RdmaCore::RdmaCore(EngineContext& c, RdmaSettings s, const VerbsApi& v, std::vector<NicPtr> nics)
    : ctx(c), settings(std::move(s)), verbs(v), nics_(std::move(nics)) {
  poller_ = std::make_shared<CompletionPoller>(settings.config.pollCqMode, nics_, settings.stallTimeoutMs);
  if (settings.workerThreads() > 0) workers_ = std::make_unique<PostWorkers>(settings.workerThreads());
}

RdmaCore::~RdmaCore() { Shutdown(); }

void RdmaCore::Shutdown() {
  if (closed_.exchange(true)) return;
  std::unordered_map<std::string, std::shared_ptr<PeerLink>> peers;
  {
    std::lock_guard<std::mutex> lock(peersMu_);
    peers.swap(peers_);
  }
  for (auto& [k, p] : peers) p->Close();
  if (workers_) workers_->Stop();
  poller_->Stop("the RDMA backend was removed or the engine is shutting down");
}

NicPtr RdmaCore::NicById(const std::string& id) const {
  for (const auto& n : nics_)
    if (n->Id() == id) return n;
  return nullptr;
}

uint8_t RdmaCore::LinkLayerMask() const {
  uint8_t m = 0;
  for (const auto& n : nics_) m |= static_cast<uint8_t>(1u << n->linkLayer);
  return m;
}

NicPtr RdmaCore::NicFor(const MemoryDesc& d) {
  std::lock_guard<std::mutex> lock(memMu_);
  auto it = nicOfMemory_.find(d.id);
  if (it != nicOfMemory_.end()) return nics_[it->second];
  size_t idx = 0;
  if (d.loc == MemoryLocationType::GPU) {
    auto g = nicOfGpu_.find(d.deviceBusId);
    if (g != nicOfGpu_.end()) {
      idx = g->second;
    } else {
      std::vector<std::string> names;
      for (const auto& n : nics_) names.push_back(n->name);
      auto ranked = SysfsTopology(settings.sysfsRoot).Rank(d.deviceBusId, names);
      idx = PickClosest(ranked, d.deviceId);
      nicOfGpu_[d.deviceBusId] = idx;
      MORI_INFO("RDMA: GPU " << d.deviceId << " (" << d.deviceBusId << ") uses " << nics_[idx]->Id() << " (path "
                             << ToString(ranked[idx].path) << ")");
    }
  } else if (settings.hostNicIndex >= 0) {
    idx = static_cast<size_t>(settings.hostNicIndex) % nics_.size();
  } else {
    std::vector<int> numa;
    for (const auto& n : nics_) numa.push_back(n->numaNode);
    idx = PickForHostMemory(numa, d.numaNode, hostRoundRobin_++);
  }
  nicOfMemory_[d.id] = idx;
  return nics_[idx];
}

MrPtr RdmaCore::RegionMr(const MemoryDesc& d, std::string* err) {
  {
    std::lock_guard<std::mutex> lock(memMu_);
    auto it = mrs_.find(d.id);
    if (it != mrs_.end()) return it->second;
  }
  NicPtr nic = NicFor(d);
  MrPtr mr = MemoryRegion::Register(nic, d, settings, err);
  if (!mr) return nullptr;
  std::lock_guard<std::mutex> lock(memMu_);
  auto [it, inserted] = mrs_.emplace(d.id, mr);
  return it->second;  // a concurrent registration may have won; ours is released
}

void RdmaCore::DropMemory(MemoryUniqueId id) {
  MrPtr mr;
  {
    std::lock_guard<std::mutex> lock(memMu_);
    auto it = mrs_.find(id);
    if (it != mrs_.end()) {
      mr = std::move(it->second);
      mrs_.erase(it);
    }
    nicOfMemory_.erase(id);
  }
  // Deregistered now, even if a session still holds the object: from here on
  // the NIC refuses remote access to these bytes.
  if (mr) mr->Deregister();
}

std::shared_ptr<PeerLink> RdmaCore::Peer(const std::string& key) {
  std::lock_guard<std::mutex> lock(peersMu_);
  auto it = peers_.find(key);
  if (it != peers_.end()) return it->second;
  if (closed_) return nullptr;
  EngineDesc d;
  if (!ctx.remotes.Get(key, &d)) return nullptr;
  auto p = std::make_shared<PeerLink>(*this, d);
  peers_[key] = p;
  return p;
}

void RdmaCore::UpdatePeer(const EngineDesc& d) {
  std::shared_ptr<PeerLink> old;
  {
    std::lock_guard<std::mutex> lock(peersMu_);
    auto it = peers_.find(d.key);
    if (it == peers_.end() || it->second->desc() == d) return;
    old = std::move(it->second);
    peers_.erase(it);
  }
  old->Close();
}

void RdmaCore::ForgetPeer(const std::string& key) {
  std::shared_ptr<PeerLink> old;
  {
    std::lock_guard<std::mutex> lock(peersMu_);
    auto it = peers_.find(key);
    if (it == peers_.end()) return;
    old = std::move(it->second);
    peers_.erase(it);
  }
  old->Close();
}

bool RdmaCore::Resolve(const MemoryDesc& local, const MemoryDesc& remote, Route* route, StatusCode* code,
                       std::string* err) {
  if (closed_) {
    *code = StatusCode::ERR_BAD_STATE;
    *err = "the RDMA backend was removed";
    return false;
  }
  route->peer = Peer(remote.engineKey);
  if (!route->peer) {
    *code = StatusCode::ERR_NOT_FOUND;
    *err = "remote engine '" + remote.engineKey + "' is not registered";
    return false;
  }
  route->local = RegionMr(local, err);
  if (!route->local) {
    *code = StatusCode::ERR_RDMA_OP;
    return false;
  }
  // At most twice: a rebuilt connection invalidates the rkey fetched before it.
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (!route->peer->Memory(remote, &route->remote, code, err)) return false;
    bool rebuilt = false;
    route->group = route->peer->Group(route->local->nic, route->remote.nic, &rebuilt, err);
    if (!route->group) {
      *code = StatusCode::ERR_BAD_STATE;
      return false;
    }
    if (!rebuilt) return true;
  }
  *code = StatusCode::ERR_BAD_STATE;
  *err = "the RDMA connection to engine '" + remote.engineKey + "' failed again right after being rebuilt: " +
         route->group->FirstFailure();
  return false;
}

void RdmaCore::Post(const Route& route, const SegmentList& segments, TransferUniqueId uid, bool isRead,
                    const StatusPtr& status, RegionPin pin) {
  const QpGroup& g = *route.group;
  PlanLimits lim;
  lim.numQps = static_cast<int>(g.qps.size());
  lim.postBatchSize = settings.config.postBatchSize;
  lim.sqDepth = g.qps[0]->sqDepth();
  lim.maxSge = static_cast<int>(g.qps[0]->maxSge());
  uint64_t maxMsg = g.nic->maxMsgSize ? g.nic->maxMsgSize : (1ull << 31);
  if (g.remoteMaxMsg) maxMsg = std::min<uint64_t>(maxMsg, g.remoteMaxMsg);
  lim.maxMsgBytes = maxMsg;
  lim.chunking = settings.config.enableTransferChunking;
  lim.chunkBytes = settings.config.chunkBytes;
  lim.maxChunks = settings.config.maxChunksPerTransfer;
  lim.notify = settings.config.enableNotification;
  std::shared_ptr<const PostPlan> plan;
  try {
    plan = std::make_shared<const PostPlan>(PlanPosts(segments, uid, lim));
  } catch (const std::exception& e) {
    status->Update(StatusCode::ERR_INVALID_ARGS, e.what());
    return;
  }
  if (plan->chains.empty()) {
    status->Update(StatusCode::SUCCESS);
    return;
  }
  const bool notify = settings.config.enableNotification;
  const uint16_t total = static_cast<uint16_t>(plan->qpsUsed.size());
  auto xfer = std::make_shared<RdmaTransfer>();
  xfer->status = status;
  xfer->localPin = std::move(pin);
  xfer->keepAlive = std::make_shared<Route>(route);
  xfer->remaining.store(static_cast<uint32_t>(plan->chains.size() + (notify ? plan->qpsUsed.size() : 0)));

  std::vector<std::vector<uint32_t>> perQp(g.qps.size());
  for (uint32_t i = 0; i < plan->chains.size(); ++i) perQp[plan->chains[i].qp].push_back(i);
  for (int q : plan->qpsUsed) {
    if (workers_) {
      std::vector<uint32_t> chains = std::move(perQp[q]);
      Route r = route;
      // `this` outlives every task: Shutdown() stops (and drains) the workers
      // before the core can be destroyed.
      workers_->Enqueue(g.qps[q]->serial(), [this, plan, xfer, r, q, chains, notify, total, uid, isRead](bool cancelled) {
        PostOnQp(plan, xfer, r, q, chains, notify, total, uid, isRead, cancelled);
      });
    } else {
      PostOnQp(plan, xfer, route, q, perQp[q], notify, total, uid, isRead, false);
    }
  }
}

void RdmaCore::PostOnQp(const std::shared_ptr<const PostPlan>& plan, const TransferPtr& xfer, const Route& route,
                        int qpIndex, const std::vector<uint32_t>& chains, bool notify, uint16_t notifyTotal,
                        uint64_t uid, bool isRead, bool cancelled) {
  QueuePair& qp = *route.group->qps[qpIndex];
  // Reused per thread: posting allocates nothing in steady state.
  thread_local std::vector<ibv_send_wr> wrs;
  thread_local std::vector<ibv_sge> sges;
  std::string err = cancelled ? "the RDMA backend is shutting down" : "";
  size_t k = 0;
  for (; k < chains.size() && err.empty(); ++k) {
    const PlannedChain& c = plan->chains[chains[k]];
    wrs.assign(c.numWrs, ibv_send_wr{});
    size_t nSge = 0;
    for (uint32_t j = 0; j < c.numWrs; ++j) nSge += plan->wrs[c.firstWr + j].numSge;
    sges.resize(nSge);
    size_t s = 0;
    for (uint32_t j = 0; j < c.numWrs; ++j) {
      const PlannedWr& p = plan->wrs[c.firstWr + j];
      ibv_send_wr& w = wrs[j];
      w.sg_list = &sges[s];
      w.num_sge = static_cast<int>(p.numSge);
      for (uint32_t e = 0; e < p.numSge; ++e, ++s) {
        const SgePiece& piece = plan->sges[p.firstSge + e];
        sges[s].addr = route.local->addr + piece.localOffset;
        sges[s].length = static_cast<uint32_t>(piece.length);
        sges[s].lkey = route.local->lkey;
      }
      w.opcode = isRead ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
      w.wr.rdma.remote_addr = route.remote.addr + p.remoteOffset;
      w.wr.rdma.rkey = route.remote.rkey;
      w.send_flags = j + 1 == c.numWrs ? static_cast<unsigned>(IBV_SEND_SIGNALED) : 0u;
      w.next = j + 1 < c.numWrs ? &wrs[j + 1] : nullptr;
    }
    if (!qp.PostChain(wrs.data(), c.numWrs, xfer, isRead, false, &err)) break;
  }
  if (!err.empty()) {
    // Parts that never reached the queue are resolved here, with the cause.
    size_t unposted = chains.size() - k + (notify ? 1 : 0);
    for (size_t i = 0; i < unposted; ++i) xfer->PartDone(StatusCode::ERR_RDMA_OP, err);
    return;
  }
  if (notify && !qp.PostNotification(uid, notifyTotal, isRead, xfer, &err)) xfer->PartDone(StatusCode::ERR_RDMA_OP, err);
}

MemoryInfoReply RdmaCore::DescribeMemory(uint32_t memId) {
  MemoryInfoReply m;
  RegionPin pin = ctx.memory.Pin(memId);
  if (!pin) {
    m.code = StatusCode::ERR_NOT_FOUND;
    m.message = "memory " + std::to_string(memId) + " is not registered on engine '" + ctx.key + "'";
    return m;
  }
  std::string err;
  MrPtr mr = RegionMr(pin.desc(), &err);
  if (!mr) {
    m.code = StatusCode::ERR_RDMA_OP;
    m.message = err;
    return m;
  }
  m.nic = mr->nic->Id();
  m.addr = mr->addr;
  m.size = mr->length;
  m.rkey = mr->rkey;
  return m;
}

ConnectedReply RdmaCore::AcceptConnect(const std::string& peerKey, const ConnectRequest& req,
                                       std::map<uint64_t, GroupPtr>* groups) {
  ConnectedReply r;
  NicPtr nic = NicById(req.targetNic);
  if (!nic) {
    r.code = StatusCode::ERR_NOT_FOUND;
    r.message = "engine '" + ctx.key + "' has no RDMA port " + req.targetNic;
    return r;
  }
  if (groups->size() >= kMaxGroupsPerConnection && !groups->count(req.groupId)) {
    r.code = StatusCode::ERR_BAD_STATE;
    r.message = "engine '" + ctx.key + "' refuses more than " + std::to_string(kMaxGroupsPerConnection) +
                " queue-pair groups per peer connection";
    return r;
  }
  auto g = std::make_shared<QpGroup>();
  g->id = req.groupId;
  g->nic = nic;
  g->remoteNic = req.initiator.nic;
  g->poller = poller_;
  try {
    for (const auto& q : req.qps) {
      auto qp = std::make_shared<QueuePair>(nic, QueuePair::Role::Target, settings, peerKey, &ctx.notifications,
                                            NextQpSerial());
      qp->Connect(req.initiator, q);
      g->qps.push_back(std::move(qp));
    }
  } catch (const std::exception& e) {
    r.code = StatusCode::ERR_RDMA_OP;
    r.message = std::string("engine '") + ctx.key + "' could not connect queue pairs on " + nic->Id() + ": " + e.what();
    return r;
  }
  for (const auto& q : g->qps) {
    poller_->Add(q);
    r.qps.push_back(q->Address());
  }
  r.target = nic->Address();
  (*groups)[req.groupId] = std::move(g);
  return r;
}

std::vector<uint8_t> RdmaCore::Serve(const std::string& peerKey, const std::vector<uint8_t>& request,
                                     std::map<uint64_t, GroupPtr>* groups) {
  // Decoders throw on malformed input; the caller drops the connection.
  switch (PeekType(request)) {
    case MsgType::Hello: {
      HelloReply h;
      h.linkLayerMask = LinkLayerMask();
      h.numNics = static_cast<uint16_t>(nics_.size());
      return Encode(h);
    }
    case MsgType::GetMemory:
      return Encode(DescribeMemory(DecodeGetMemory(request).memId));
    case MsgType::Connect:
      return Encode(AcceptConnect(peerKey, DecodeConnect(request), groups));
    case MsgType::Release: {
      for (uint64_t id : DecodeRelease(request).groupIds) groups->erase(id);
      return Encode(ReleasedReply{});
    }
    default:
      throw InvalidArgument("RDMA control: unexpected message type " +
                            std::to_string(static_cast<int>(PeekType(request))) + " from a peer");
  }
}

}  // namespace mori::io::rdma
