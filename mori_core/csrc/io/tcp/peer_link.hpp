// Outbound side of the TCP backend: the sockets to one remote engine.
//
// A PeerLink owns `numConnections` Connections. Each Connection has a sender
// thread (dials on start, then writes frames from its queue) and a receiver
// thread (reads replies in request order, lands READ data in local memory,
// resolves frames). A connection that breaks — peer closed, reset, or no
// progress for opTimeoutMs while requests are outstanding — fails everything
// it holds and is replaced by a fresh one on the next submission. A
// connection with nothing outstanding for half the peer's idle timeout retires
// itself (the next submission dials a fresh one), so targets never have to
// close a connection an initiator is about to use.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/common.hpp"
#include "io/memory_table.hpp"
#include "io/net/control_plane.hpp"
#include "io/tcp/gpu_staging.hpp"
#include "io/tcp/heartbeat.hpp"
#include "io/tcp/transfer_state.hpp"

namespace mori::io::tcp {

struct LinkTarget {
  EngineDesc remote;
  net::HandshakeOptions handshake;
  TcpBackendConfig config;
};

class Connection {
 public:
  Connection(const LinkTarget& target, int index);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // False (frame not taken) when the connection retired itself as idle:
  // the caller retries on a fresh one.
  bool Enqueue(FramePtr frame);
  bool Broken() const { return broken_.load(); }
  size_t Outstanding() const { return outstanding_.load(); }
  // Fails everything this connection holds (the peer was found stopped).
  void Abort(const std::string& reason) { Fail(reason); }
  // Deregistration of a local region whose bytes this connection moves cuts it.
  const CutPtr& cut() const { return cut_; }

 private:
  void SendLoop();
  void RecvLoop();
  // Builds the frame's header, segment table and iovecs (data too for CPU writes).
  void Prepare(Frame& f);
  // Sends what is left of a prepared frame, blocking with the op timeout.
  bool SendRest(Frame& f, std::string* err);
  // Bookkeeping after this thread stopped sending `f`; releases the send token.
  void AfterSend(const FramePtr& f, bool ok, const std::string& err);
  void Resolve(const FramePtr& f, StatusCode code, const std::string& message);
  bool WaitForReply(std::string* err);
  bool ReceiveReply(std::string* err);
  void Fail(const std::string& reason);

  const LinkTarget& target_;
  const int index_;
  net::Socket sock_;
  std::thread sender_, receiver_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<FramePtr> queue_;     // not yet sent
  std::deque<FramePtr> inflight_;  // sent (or being sent), awaiting a reply
  std::atomic<bool> broken_{false};
  std::atomic<bool> stop_{false};
  std::atomic<size_t> outstanding_{0};
  std::atomic<int64_t> lastProgressMs_{0};
  uint64_t nextRequestId_ = 1;
  // One thread at a time writes to the socket: the holder of this token.
  // A caller whose frame fits sends it itself (no thread wake-up); if the
  // socket fills up, the rest is handed to the sender thread via handoff_.
  bool senderBusy_ = false;
  bool dialed_ = false;
  FramePtr handoff_;
  bool retired_ = false;  // idle retirement: Enqueue refuses, the link dials anew
  std::string failReason_;
  DeviceStager txStager_, rxStager_;
  net::FrameMac txMac_, rxMac_;  // request tags (token holder) / reply tags (receiver thread)
  CutPtr cut_ = std::make_shared<CutHandle>();
};

class PeerLink {
 public:
  explicit PeerLink(LinkTarget target);
  ~PeerLink();

  // Splits a transfer into frames and spreads them over the connections.
  void Submit(const std::shared_ptr<TcpTransfer>& xfer, uint32_t remoteMemId, const SegmentList& segments,
              TransferUniqueId uid, bool isRead);
  const EngineDesc& remote() const { return target_.remote; }
  bool Alive() const { return alive_.load(); }
  void Close();

 private:
  std::shared_ptr<Connection> ConnectionAt(size_t i);
  bool Busy();
  void AbortAll(const std::string& reason);

  LinkTarget target_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Connection>> conns_;
  std::atomic<size_t> rr_{0};
  std::atomic<bool> alive_{true};
  Heartbeat heartbeat_;  // last: stopped (joined) before the connections go
};

// Frame planning, exposed for tests: frames of at most `frameBytes` and
// kMaxSegmentsPerFrame segments, splitting large segments.
std::vector<SegmentList> PlanFrames(const SegmentList& segments, uint64_t frameBytes);
uint64_t ChooseFrameBytes(uint64_t total, const TcpBackendConfig& cfg);

}  // namespace mori::io::tcp
