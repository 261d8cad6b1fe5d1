#include "io/rdma/queue_pair.hpp"

#include <chrono>
#include <cstring>
#include <random>

#include "common/error.hpp"
#include "common/logging.hpp"
#include "io/rdma/completion_errors.hpp"

namespace mori::io::rdma {

using namespace abi;

namespace {

constexpr uint32_t kRecvSlotBytes = 64;  // > sizeof(NotifMessage): a larger SEND fails visibly, not silently
constexpr int kPollBatch = 32;
constexpr int64_t kFlushGraceMs = 2000;  // how long a failed QP may take to flush its work requests
constexpr uint16_t kNotifVersion = 1;

// Targets never post sends (reads are answered by the NIC without WQEs),
// so their send queue stays minimal.
uint32_t SendQueueDepth(QueuePair::Role role, const RdmaSettings& s, const NicContext& nic) {
  constexpr int kMinDepth = 16;
  if (role == QueuePair::Role::Target) return kMinDepth;
  int depth = s.maxSendWr();
  if (nic.maxQpWr > 0) depth = std::min(depth, nic.maxQpWr);
  return static_cast<uint32_t>(std::max(depth, kMinDepth));
}

uint32_t RandomPsn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

}  // namespace

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

QueuePair::QueuePair(NicPtr nic, Role role, const RdmaSettings& s, std::string peerKey,
                     NotificationTable* notifications, uint64_t serial)
    : nic_(std::move(nic)),
      role_(role),
      settings_(s),
      peerKey_(std::move(peerKey)),
      notifications_(notifications),
      serial_(serial),
      credits_(SendQueueDepth(role, s, *nic_)) {
  const VerbsApi& v = nic_->verbs;
  const uint32_t sq = credits_.depth();
  const uint32_t rq = role == Role::Target ? static_cast<uint32_t>(s.config.notifPerQp) : 1;
  const int cqe = static_cast<int>(sq + rq);
  if (nic_->maxCqe > 0 && cqe > nic_->maxCqe)
    throw BadState(nic_->name + " supports CQs of " + std::to_string(nic_->maxCqe) + " entries, fewer than the " +
                   std::to_string(cqe) + " this QP needs (lower RdmaBackendConfig.max_send_wr / notif_per_qp)");
  cq_ = v.create_cq(nic_->context, cqe, this, nic_->channel, 0);
  if (!cq_)
    throw BadState("ibv_create_cq(" + std::to_string(cqe) + " entries) on " + nic_->name +
                   " failed: " + std::strerror(errno) + " (lower RdmaBackendConfig.max_cqe_num / max_send_wr)");
  maxSge_ = static_cast<uint32_t>(std::max(1, std::min(s.maxSge(), nic_->maxSge > 0 ? nic_->maxSge : 1)));
  ibv_qp_init_attr init{};
  init.send_cq = cq_;
  init.recv_cq = cq_;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signalling
  init.cap.max_send_wr = sq;
  init.cap.max_recv_wr = rq;
  init.cap.max_send_sge = maxSge_;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = role == Role::Initiator ? static_cast<uint32_t>(s.maxInlineData) : 0;
  qp_ = v.create_qp(nic_->pd, &init);
  if (!qp_ && init.cap.max_inline_data > 0) {
    // Some devices cannot inline at all; notifications then use a registered buffer.
    init.cap.max_inline_data = 0;
    qp_ = v.create_qp(nic_->pd, &init);
  }
  if (!qp_) {
    int e = errno;
    v.destroy_cq(cq_);
    throw BadState("ibv_create_qp(RC, send " + std::to_string(sq) + ", recv " + std::to_string(rq) + ", sge " +
                   std::to_string(maxSge_) + ") on " + nic_->name + " failed: " + std::strerror(e) +
                   " (lower RdmaBackendConfig.max_send_wr / max_msg_sge / notif_per_qp)");
  }
  qpn_ = qp_->qp_num;
  psn_ = RandomPsn();
  inlineNotify_ = init.cap.max_inline_data >= sizeof(NotifMessage);

  if (role == Role::Target || !inlineNotify_) {
    slots_ = role == Role::Target ? rq : sq;
    const uint32_t slotBytes = role == Role::Target ? kRecvSlotBytes : sizeof(NotifMessage);
    slab_.assign(static_cast<size_t>(slots_) * slotBytes, 0);
    int e = 0;
    slabMr_ = RegisterPlain(*nic_, slab_.data(), slab_.size(), IBV_ACCESS_LOCAL_WRITE, false, &e);
    if (!slabMr_) {
      v.destroy_qp(qp_);
      v.destroy_cq(cq_);
      throw BadState("cannot register the notification buffers on " + nic_->name + ": " + std::strerror(e));
    }
  }
  if (nic_->channel && !RequestNotify()) MORI_WARN("RDMA: ibv_req_notify_cq failed on " << nic_->name);
}

QueuePair::~QueuePair() {
  Shutdown("the queue pair was destroyed");
  const VerbsApi& v = nic_->verbs;
  if (qp_ && v.destroy_qp(qp_) != 0) MORI_WARN("RDMA: ibv_destroy_qp failed: " << std::strerror(errno));
  if (slabMr_) v.dereg_mr(slabMr_);
  if (cq_ && v.destroy_cq(cq_) != 0) MORI_WARN("RDMA: ibv_destroy_cq failed: " << std::strerror(errno));
}

void QueuePair::Modify(ibv_qp_attr& attr, int mask, const char* step) {
  int rc = nic_->verbs.modify_qp(qp_, &attr, mask);
  if (rc != 0)
    throw BadState(std::string("moving the RC QP on ") + nic_->name + " to " + step + " failed: " +
                   std::strerror(rc > 0 ? rc : errno) +
                   (std::string(step) == "RTR" ? " (unreachable address: check MORI_IB_GID_INDEX / MORI_IB_PATH_MTU)"
                                               : ""));
}

void QueuePair::Connect(const PortAddress& remote, const QpAddress& remoteQp) {
  if (remote.linkLayer != nic_->linkLayer)
    throw BadState("cannot connect " + nic_->name + " (" + (nic_->linkLayer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB") +
                   ") to " + remote.nic + " (" + (remote.linkLayer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB") +
                   "): link layers differ (select matching NICs with MORI_RDMA_DEVICES)");
  const int localAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = static_cast<uint8_t>(nic_->port);
  a.qp_access_flags = localAccess;
  Modify(a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");

  if (role_ == Role::Target)
    for (uint32_t i = 0; i < slots_; ++i)
      if (!PostRecv(i)) throw BadState("posting notification receive buffers on " + nic_->name + " failed");

  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTR;
  int mtu = std::min<int>(nic_->activeMtu, remote.activeMtu);
  if (settings_.pathMtu > 0) mtu = std::min(mtu, MtuEnumFromBytes(settings_.pathMtu));
  a.path_mtu = static_cast<ibv_mtu>(mtu);
  a.dest_qp_num = remoteQp.qpn;
  a.rq_psn = remoteQp.psn;
  a.max_dest_rd_atomic = static_cast<uint8_t>(nic_->maxDestRdAtomic);
  a.min_rnr_timer = static_cast<uint8_t>(settings_.minRnrTimer);
  a.ah_attr.dlid = remote.lid;
  a.ah_attr.sl = static_cast<uint8_t>(settings_.serviceLevel);
  a.ah_attr.port_num = static_cast<uint8_t>(nic_->port);
  if (nic_->gidIndex >= 0) {
    if (!remote.useGrh)
      throw BadState("peer port " + remote.nic + " has no GID but " + nic_->name + " routes with GRH");
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, remote.gid.data(), 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(nic_->gidIndex);
    a.ah_attr.grh.hop_limit = 255;  // not 1: routed RoCE fabrics drop hop-limit-1 packets (MORI PR #588)
    a.ah_attr.grh.traffic_class = static_cast<uint8_t>(settings_.trafficClass);
  }
  Modify(a,
         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
             IBV_QP_MIN_RNR_TIMER,
         "RTR");

  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = static_cast<uint8_t>(settings_.qpTimeout);
  a.retry_cnt = static_cast<uint8_t>(settings_.retryCount);
  a.rnr_retry = static_cast<uint8_t>(settings_.rnrRetry);
  a.sq_psn = psn_;
  // Never more outstanding reads than the responder accepts.
  a.max_rd_atomic = static_cast<uint8_t>(std::max(1, std::min<int>(nic_->maxRdAtomic, remote.maxRdAtomic)));
  Modify(a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
         "RTS");
}

bool QueuePair::PostRecv(uint32_t slot) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uint64_t>(slab_.data()) + static_cast<uint64_t>(slot) * kRecvSlotBytes;
  sge.length = kRecvSlotBytes;
  sge.lkey = slabMr_->lkey;
  ibv_recv_wr wr{};
  wr.wr_id = slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return VerbsApi::PostRecv(qp_, &wr, &bad) == 0;
}

bool QueuePair::RequestNotify() { return VerbsApi::ReqNotifyCq(cq_, 0) == 0; }

bool QueuePair::Busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !outstanding_.empty();
}

std::string QueuePair::BrokenReason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return brokenReason_;
}

void QueuePair::MarkBrokenLocked(const std::string& reason, int64_t nowMs) {
  if (broken_.exchange(true)) return;
  brokenReason_ = reason;
  brokenAtMs_ = nowMs;
  credits_.Abort();
  MORI_WARN("RDMA: queue pair " << qpn_ << " on " << nic_->name << " to engine '" << peerKey_ << "' failed: " << reason);
}

void QueuePair::MoveToError() {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  (void)nic_->verbs.modify_qp(qp_, &a, IBV_QP_STATE);
}

bool QueuePair::PostChain(ibv_send_wr* first, uint32_t numWrs, const TransferPtr& xfer, bool isRead, bool notify,
                          std::string* err) {
  const auto t0 = std::chrono::steady_clock::now();
  switch (credits_.Acquire(numWrs, settings_.sqBackoffTimeoutUs)) {
    case SqCredits::Result::Ok:
      break;
    case SqCredits::Result::Aborted:
      *err = "queue pair to engine '" + peerKey_ + "' on " + nic_->name + " failed earlier: " + BrokenReason();
      return false;
    case SqCredits::Result::TooLarge:
      *err = "a chain of " + std::to_string(numWrs) + " work requests exceeds the send queue depth " +
             std::to_string(credits_.depth()) + " (lower post_batch_size)";
      return false;
    case SqCredits::Result::TimedOut: {
      auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
      *err = DescribeSendQueueFull(credits_.depth(), numWrs, us);
      return false;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_) {
    credits_.Release(numWrs);
    *err = "queue pair to engine '" + peerKey_ + "' failed earlier: " + brokenReason_;
    return false;
  }
  const uint64_t seq = nextSeq_++;
  for (ibv_send_wr* w = first; w; w = w->next) w->wr_id = seq;
  const int64_t now = SteadyNowMs();
  if (outstanding_.empty()) lastProgressMs_ = now;
  outstanding_.push_back({seq, numWrs, xfer, isRead, notify});
  ibv_send_wr* bad = nullptr;
  int rc = VerbsApi::PostSend(qp_, first, &bad);
  if (rc == 0) return true;
  std::string why = DescribePostFailure(rc);
  if (bad == first) {
    // Nothing reached the queue: the caller resolves the part.
    outstanding_.pop_back();
    credits_.Release(numWrs);
    *err = why;
    MarkBrokenLocked(why, now);
    return false;
  }
  // Part of the chain was posted without its signalled tail: flush the QP so
  // the posted part completes (with an error) and the record is resolved.
  MarkBrokenLocked(why + " (after part of a chain was posted)", now);
  MoveToError();
  return true;
}

bool QueuePair::PostNotification(uint64_t uid, uint16_t total, bool isRead, const TransferPtr& xfer,
                                 std::string* err) {
  NotifMessage msg{kNotifMagic, kNotifVersion, total, uid};
  ibv_sge sge{};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  // Signalled so the initiator's SUCCESS implies the target received it (MORI PR #434).
  // Fenced after reads: the SEND must not overtake the data it announces.
  wr.send_flags = IBV_SEND_SIGNALED | (isRead ? static_cast<unsigned>(IBV_SEND_FENCE) : 0u);
  sge.length = sizeof(msg);
  if (inlineNotify_) {
    wr.send_flags |= IBV_SEND_INLINE;
    sge.addr = reinterpret_cast<uint64_t>(&msg);
    return PostChain(&wr, 1, xfer, isRead, true, err);
  }
  // No inline: a slot of the registered ring. A slot is reused only after
  // `sqDepth` later posts, and SQ admission guarantees its SEND completed by then.
  uint64_t slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot = nextSendSlot_++ % slots_;
  }
  uint8_t* p = slab_.data() + slot * sizeof(NotifMessage);
  std::memcpy(p, &msg, sizeof(msg));
  sge.addr = reinterpret_cast<uint64_t>(p);
  sge.lkey = slabMr_->lkey;
  return PostChain(&wr, 1, xfer, isRead, true, err);
}

int QueuePair::Poll(int64_t nowMs) {
  ibv_wc wcs[kPollBatch];
  int n = VerbsApi::PollCq(cq_, kPollBatch, wcs);
  if (n < 0) {
    std::lock_guard<std::mutex> lock(mu_);
    MarkBrokenLocked("ibv_poll_cq failed (" + std::to_string(n) + ")", nowMs);
    return 0;
  }
  for (int i = 0; i < n; ++i) {
    // Dispatch by role: the opcode of a failed completion is undefined.
    if (role_ == Role::Target) HandleRecv(wcs[i]);
    else HandleSend(wcs[i], nowMs);
  }
  return n;
}

void QueuePair::HandleSend(const ibv_wc& wc, int64_t nowMs) {
  struct Done {
    TransferPtr xfer;
    StatusCode code;
    std::string message;
  };
  std::vector<Done> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lastProgressMs_ = nowMs;
    std::string failure;
    if (wc.status != IBV_WC_SUCCESS) {
      bool notifyWr = false, isRead = false;
      for (const auto& c : outstanding_)
        if (c.seq == wc.wr_id) notifyWr = c.notify, isRead = c.isRead;
      failure = DescribeCompletionError(wc.status, wc.vendor_err, isRead, notifyWr);
      if (wc.status == IBV_WC_WR_FLUSH_ERR && !brokenReason_.empty()) failure = brokenReason_ + "; " + failure;
      failure = "engine '" + peerKey_ + "' via " + nic_->name + ": " + failure;
      MarkBrokenLocked(failure, nowMs);
    }
    // RC completes in order: a completion for chain `wr_id` also covers every
    // earlier chain; one for an already-resolved chain (a flushed unsignalled
    // WR after the chain failed) is ignored.
    while (!outstanding_.empty() && outstanding_.front().seq <= wc.wr_id) {
      Chain c = std::move(outstanding_.front());
      outstanding_.pop_front();
      credits_.Release(c.numWrs);
      bool failed = c.seq == wc.wr_id && !failure.empty();
      done.push_back({std::move(c.xfer), failed ? StatusCode::ERR_RDMA_OP : StatusCode::SUCCESS,
                      failed ? failure : std::string()});
    }
  }
  for (auto& d : done) d.xfer->PartDone(d.code, d.message);
}

void QueuePair::HandleRecv(const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    // Flushes happen when the initiator's QP failed or this QP is torn down.
    if (wc.status != IBV_WC_WR_FLUSH_ERR && !loggedRecvError_) {
      loggedRecvError_ = true;
      MORI_WARN("RDMA: notification receive from engine '"
                << peerKey_ << "' on " << nic_->name << " failed: "
                << DescribeCompletionError(wc.status, wc.vendor_err, false, true));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_) MarkBrokenLocked("receive completion error", SteadyNowMs());
    return;
  }
  const uint64_t slot = wc.wr_id;
  if (slot >= slots_) {
    MORI_WARN("RDMA: receive completion with unknown slot " << slot << " from engine '" << peerKey_ << "'");
    return;
  }
  NotifMessage msg{};
  std::memcpy(&msg, slab_.data() + slot * kRecvSlotBytes, sizeof(msg));
  if (wc.byte_len != sizeof(msg) || msg.magic != kNotifMagic || msg.version != kNotifVersion || msg.total == 0 ||
      msg.total > kMaxQpsPerGroup) {
    MORI_WARN("RDMA: malformed notification (" << wc.byte_len << " bytes) from engine '" << peerKey_ << "' ignored");
  } else if (notifications_) {
    notifications_->Record(peerKey_, msg.uid, msg.total);
  }
  if (!PostRecv(static_cast<uint32_t>(slot))) {
    std::lock_guard<std::mutex> lock(mu_);
    MarkBrokenLocked("re-posting a notification receive failed", SteadyNowMs());
  }
}

void QueuePair::CheckStall(int64_t nowMs, int64_t stallMs) {
  std::vector<TransferPtr> victims;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (outstanding_.empty()) return;
    if (!broken_) {
      if (stallMs <= 0 || nowMs - lastProgressMs_ < stallMs) return;
      MarkBrokenLocked("no completion for " + std::to_string(nowMs - lastProgressMs_) +
                           " ms with work outstanding (MORI_IO_QP_STALL_TIMEOUT_MS); queue pair flushed",
                       nowMs);
      MoveToError();
      return;  // the flush completions resolve the chains
    }
    if (nowMs - std::max(brokenAtMs_, lastProgressMs_) < kFlushGraceMs) return;
    // The device never flushed: make sure it stops, then fail what is left.
    MoveToError();
    reason = "engine '" + peerKey_ + "' via " + nic_->name + ": " + brokenReason_ +
             " (no flush completion within " + std::to_string(kFlushGraceMs) + " ms)";
    for (auto& c : outstanding_) {
      credits_.Release(c.numWrs);
      victims.push_back(std::move(c.xfer));
    }
    outstanding_.clear();
  }
  for (auto& x : victims) x->PartDone(StatusCode::ERR_RDMA_OP, reason);
}

void QueuePair::Shutdown(const std::string& reason) {
  std::vector<TransferPtr> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.exchange(true)) {
      brokenReason_ = reason;
      brokenAtMs_ = SteadyNowMs();
      credits_.Abort();
    }
    if (!outstanding_.empty()) MoveToError();
    for (auto& c : outstanding_) victims.push_back(std::move(c.xfer));
    outstanding_.clear();
  }
  for (auto& x : victims) x->PartDone(StatusCode::ERR_BAD_STATE, "RDMA transfer aborted: " + reason);
}

}  // namespace mori::io::rdma
