// One RC queue pair with its own completion queue.
//
// Initiator QPs carry RDMA READ/WRITE chains and the notification SENDs;
// every chain is recorded (in posting order) before it is posted and resolved
// by the completion of its signalled last WR — or, when the QP fails, by the
// error/flush completion, so exactly the transfers that were on this QP fail.
// Target QPs only receive notifications: they keep `notif_per_qp` receive
// buffers posted and count every arrival in the engine's notification table.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/notification_table.hpp"
#include "io/rdma/control_protocol.hpp"
#include "io/rdma/nic.hpp"
#include "io/rdma/sq_credits.hpp"
#include "io/rdma/transfer.hpp"

namespace mori::io::rdma {

// What a notification SEND carries (16 bytes, sent inline where supported).
struct NotifMessage {
  uint32_t magic;
  uint16_t version;
  uint16_t total;  // QPs the transfer used = notifications to expect
  uint64_t uid;
};
static_assert(sizeof(NotifMessage) == 16, "NotifMessage layout");
constexpr uint32_t kNotifMagic = 0x5946544e;  // "NTFY"

class QueuePair {
 public:
  enum class Role { Initiator, Target };

  // Creates the CQ and the QP (RESET state). Throws mori::BadState.
  QueuePair(NicPtr nic, Role role, const RdmaSettings& settings, std::string peerKey,
            NotificationTable* notifications, uint64_t serial);
  ~QueuePair();
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;

  QpAddress Address() const { return {qpn_, psn_}; }
  // RESET -> INIT -> (receives posted) -> RTR -> RTS. Throws mori::BadState.
  void Connect(const PortAddress& remote, const QpAddress& remoteQp);

  // Posts a linked chain whose last WR carries IBV_SEND_SIGNALED. Waits (up
  // to MORI_IO_SQ_BACKOFF_TIMEOUT_US) for send-queue slots. Returns false
  // with *err when nothing was posted (the caller resolves the part); true
  // means the completion path will resolve it.
  bool PostChain(abi::ibv_send_wr* first, uint32_t numWrs, const TransferPtr& xfer, bool isRead, bool notify,
                 std::string* err);
  // Posts the notification SEND for `uid` (fenced after reads).
  bool PostNotification(uint64_t uid, uint16_t total, bool isRead, const TransferPtr& xfer, std::string* err);

  // Poller side. Returns the number of completions handled.
  int Poll(int64_t nowMs);
  // Flushes a QP that made no progress for `stallMs` and fails chains whose
  // flush never arrives; bounded waits even with a misbehaving device.
  void CheckStall(int64_t nowMs, int64_t stallMs);
  // Fails every outstanding chain and refuses new ones (teardown).
  void Shutdown(const std::string& reason);
  // Arms the CQ for the next event (EVENT mode).
  bool RequestNotify();

  bool Broken() const { return broken_.load(); }
  bool Busy() const;
  abi::ibv_cq* cq() const { return cq_; }
  uint64_t serial() const { return serial_; }
  Role role() const { return role_; }
  const std::string& peerKey() const { return peerKey_; }
  const NicPtr& nic() const { return nic_; }
  uint32_t sqDepth() const { return credits_.depth(); }
  uint32_t maxSge() const { return maxSge_; }
  std::string BrokenReason() const;

 private:
  struct Chain {
    uint64_t seq;
    uint32_t numWrs;
    TransferPtr xfer;
    bool isRead;
    bool notify;
  };
  void HandleSend(const abi::ibv_wc& wc, int64_t nowMs);
  void HandleRecv(const abi::ibv_wc& wc);
  bool PostRecv(uint32_t slot);
  // Caller holds mu_.
  void MarkBrokenLocked(const std::string& reason, int64_t nowMs);
  void MoveToError();
  void Modify(abi::ibv_qp_attr& attr, int mask, const char* step);

  const NicPtr nic_;
  const Role role_;
  const RdmaSettings settings_;  // a copy: a QP may outlive the backend that made it
  const std::string peerKey_;
  NotificationTable* const notifications_;
  const uint64_t serial_;
  abi::ibv_cq* cq_ = nullptr;
  abi::ibv_qp* qp_ = nullptr;
  uint32_t qpn_ = 0;
  uint32_t psn_ = 0;
  uint32_t maxSge_ = 1;
  bool inlineNotify_ = false;

  SqCredits credits_;
  mutable std::mutex mu_;
  std::deque<Chain> outstanding_;
  uint64_t nextSeq_ = 1;
  int64_t lastProgressMs_ = 0;
  int64_t brokenAtMs_ = 0;
  std::string brokenReason_;
  std::atomic<bool> broken_{false};

  // Notification buffers: receive slots (target) / send slots when the
  // device cannot inline 16 bytes (initiator). Plain host memory, registered.
  std::vector<uint8_t> slab_;
  abi::ibv_mr* slabMr_ = nullptr;
  uint32_t slots_ = 0;
  uint64_t nextSendSlot_ = 0;
  bool loggedRecvError_ = false;
};

using QpPtr = std::shared_ptr<QueuePair>;

int64_t SteadyNowMs();

}  // namespace mori::io::rdma
