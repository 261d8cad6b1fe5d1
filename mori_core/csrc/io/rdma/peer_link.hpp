// Initiator-side view of one remote engine: the control connection to it,
// the remote regions' rkeys (fetched on first use, then cached) and the QP
// groups to each of its NIC ports (connected on first use, rebuilt after a
// failure).
//
// The control connection is persistent: the peer ties the QPs it created for
// us to it, so when it drops (either side died or gave up) both sides free
// them, and the next transfer reconnects.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/common.hpp"
#include "io/net/auth.hpp"
#include "io/net/socket.hpp"
#include "io/rdma/qp_group.hpp"

namespace mori::io::rdma {

class RdmaCore;

struct RemoteMemory {
  std::string nic;  // "<device>:<port>" on the peer
  uint64_t addr = 0;
  uint64_t size = 0;
  uint32_t rkey = 0;
};

class PeerLink : public std::enable_shared_from_this<PeerLink> {
 public:
  PeerLink(RdmaCore& core, EngineDesc desc);
  ~PeerLink();

  const EngineDesc& desc() const { return desc_; }

  // Whether the peer serves RDMA with a link layer we have (cached; a
  // negative answer is retried after a few seconds).
  bool Probe(std::string* err);
  // rkey and placement of the peer's region `memId` (cached). `code` tells
  // NOT_FOUND (peer does not know it) from BAD_STATE (peer unreachable).
  bool Memory(const MemoryDesc& remote, RemoteMemory* out, StatusCode* code, std::string* err);
  // A healthy QP group from local port `nic` to the peer's port `remoteNic`.
  // *rebuilt tells that a failed group was replaced, which also dropped the
  // cached rkeys (the caller fetches them again).
  GroupPtr Group(const NicPtr& nic, const std::string& remoteNic, bool* rebuilt, std::string* err);
  // Forget cached rkeys (after a failure they may be stale).
  void ForgetMemory();
  void Close();
  bool Closed() const { return closed_.load(); }

 private:
  bool Call(const std::vector<uint8_t>& request, std::vector<uint8_t>* reply, std::string* err);
  bool CallLocked(const std::vector<uint8_t>& request, std::vector<uint8_t>* reply, std::string* err);
  void QueueRelease(uint64_t groupId);

  RdmaCore& core_;
  const EngineDesc desc_;
  const std::string where_;

  std::mutex callMu_;  // one request in flight on the control connection
  net::Socket sock_;
  net::FrameMac txMac_, rxMac_;  // message tags under the connection's keys
  uint64_t calls_ = 0;           // requests on this connection: the tags' counter
  std::atomic<uint64_t> generation_{0};

  std::mutex connectMu_;  // one group connect at a time per peer
  std::mutex mu_;
  std::map<uint32_t, RemoteMemory> memory_;
  std::map<std::string, GroupPtr> groups_;  // "<local port>|<remote port>"
  std::vector<uint64_t> releases_;
  int probeState_ = 0;  // 0 unknown, 1 ok, -1 refused
  int64_t probeAtMs_ = 0;
  std::string probeError_;
  std::atomic<bool> closed_{false};
};

}  // namespace mori::io::rdma
