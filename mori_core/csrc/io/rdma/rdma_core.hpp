// The state of one RDMA backend, shared by the backend object, its sessions
// and the control-plane connections it serves (which may briefly outlive the
// backend after remove_backend()).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/engine_context.hpp"
#include "io/rdma/completion_poller.hpp"
#include "io/rdma/control_protocol.hpp"
#include "io/rdma/nic.hpp"
#include "io/rdma/peer_link.hpp"
#include "io/rdma/post_workers.hpp"
#include "io/rdma/qp_group.hpp"
#include "io/rdma/rdma_settings.hpp"
#include "io/segments.hpp"

namespace mori::io::rdma {

// A resolved (local region, remote region) pair, ready to post on.
struct Route {
  MrPtr local;
  RemoteMemory remote;
  GroupPtr group;
  std::shared_ptr<PeerLink> peer;
};

class RdmaCore : public std::enable_shared_from_this<RdmaCore> {
 public:
  RdmaCore(EngineContext& ctx, RdmaSettings settings, const VerbsApi& verbs, std::vector<NicPtr> nics);
  ~RdmaCore();
  RdmaCore(const RdmaCore&) = delete;
  RdmaCore& operator=(const RdmaCore&) = delete;

  // remove_backend(): refuse new work, fail what is in flight, drop peers.
  void Shutdown();
  bool Closed() const { return closed_.load(); }

  EngineContext& ctx;
  const RdmaSettings settings;
  const VerbsApi& verbs;
  const std::vector<NicPtr>& nics() const { return nics_; }
  const std::shared_ptr<CompletionPoller>& poller() const { return poller_; }
  NicPtr NicById(const std::string& id) const;
  uint8_t LinkLayerMask() const;
  uint64_t NextGroupId() { return nextGroupId_.fetch_add(1); }
  uint64_t NextQpSerial() { return nextQpSerial_.fetch_add(1); }

  // The NIC port serving a registered region (decided once per region):
  // GPU memory -> the port closest to the GPU; host memory -> round robin
  // over the NUMA-local ports (MORI_IO_RDMA_NIC_IDX pins one).
  NicPtr NicFor(const MemoryDesc& d);
  // The region's memory region on its NIC, registered on first use.
  MrPtr RegionMr(const MemoryDesc& d, std::string* err);
  void DropMemory(MemoryUniqueId id);

  // Peers (initiator side). nullptr when the engine does not know the key.
  std::shared_ptr<PeerLink> Peer(const std::string& key);
  void UpdatePeer(const EngineDesc& d);
  void ForgetPeer(const std::string& key);

  // Everything a transfer between the two regions needs; false with the
  // status code and reason when something is missing.
  bool Resolve(const MemoryDesc& local, const MemoryDesc& remote, Route* route, StatusCode* code, std::string* err);
  // Plans and posts one transfer; the status ends when every part resolved.
  void Post(const Route& route, const SegmentList& segments, TransferUniqueId uid, bool isRead,
            const StatusPtr& status, RegionPin pin);

  // Target side: answers a peer's control request. `groups` are the QP
  // groups created for that control connection (freed when it closes).
  std::vector<uint8_t> Serve(const std::string& peerKey, const std::vector<uint8_t>& request,
                             std::map<uint64_t, GroupPtr>* groups);

 private:
  void PostOnQp(const std::shared_ptr<const struct PostPlan>& plan, const TransferPtr& xfer, const Route& route,
                int qpIndex, const std::vector<uint32_t>& chains, bool notify, uint16_t notifyTotal, uint64_t uid,
                bool isRead, bool cancelled);
  MemoryInfoReply DescribeMemory(uint32_t memId);
  ConnectedReply AcceptConnect(const std::string& peerKey, const ConnectRequest& req,
                               std::map<uint64_t, GroupPtr>* groups);

  const std::vector<NicPtr> nics_;
  std::shared_ptr<CompletionPoller> poller_;
  std::unique_ptr<PostWorkers> workers_;
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> nextGroupId_{1};
  std::atomic<uint64_t> nextQpSerial_{0};

  std::mutex memMu_;
  std::unordered_map<MemoryUniqueId, size_t> nicOfMemory_;
  std::unordered_map<MemoryUniqueId, MrPtr> mrs_;
  std::unordered_map<std::string, size_t> nicOfGpu_;  // by PCI bus id
  size_t hostRoundRobin_ = 0;

  std::mutex peersMu_;
  std::unordered_map<std::string, std::shared_ptr<PeerLink>> peers_;
};

}  // namespace mori::io::rdma
