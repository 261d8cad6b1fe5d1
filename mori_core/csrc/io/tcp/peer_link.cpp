#include "io/tcp/peer_link.hpp"

#include <algorithm>
#include <poll.h>

#include <chrono>

#include "common/error.hpp"
#include "common/logging.hpp"
#include "io/tcp/wire.hpp"

namespace mori::io::tcp {
namespace {

// Frames up to this size are sent from the submitting thread when the socket is idle.
constexpr uint64_t kInlineSendBytes = 1ull << 20;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::vector<ByteRange> LocalRanges(const SegmentList& segs) {
  std::vector<ByteRange> r;
  r.reserve(segs.size());
  for (const auto& s : segs) r.emplace_back(s.localOffset, s.size);
  return r;
}

}  // namespace

// ------------------------------------------------------------- frame planning
uint64_t ChooseFrameBytes(uint64_t total, const TcpBackendConfig& cfg) {
  uint64_t n = static_cast<uint64_t>(std::max(1, cfg.numConnections));
  uint64_t per = (total + n - 1) / n;
  uint64_t hi = std::min<uint64_t>(std::max<uint64_t>(cfg.chunkBytes, 1), kMaxFrameBytes);
  uint64_t lo = std::min(cfg.minChunkBytes, hi);
  return std::clamp<uint64_t>(per, std::max<uint64_t>(lo, 1), hi);
}

std::vector<SegmentList> PlanFrames(const SegmentList& segments, uint64_t frameBytes) {
  std::vector<SegmentList> out;
  SegmentList cur;
  uint64_t curBytes = 0;
  auto flush = [&] {
    if (!cur.empty()) out.push_back(std::move(cur));
    cur = SegmentList();
    curBytes = 0;
  };
  for (Segment s : segments) {
    while (s.size > 0) {
      if (cur.size() == kMaxSegmentsPerFrame || curBytes == frameBytes) flush();
      uint64_t take = std::min(s.size, frameBytes - curBytes);
      cur.push_back({s.localOffset, s.remoteOffset, take});
      curBytes += take;
      s.localOffset += take;
      s.remoteOffset += take;
      s.size -= take;
    }
  }
  flush();
  return out;
}

// ----------------------------------------------------------------- Connection
Connection::Connection(const LinkTarget& target, int index)
    : target_(target), index_(index), txStager_(target.config.stagingBytes), rxStager_(target.config.stagingBytes) {
  lastProgressMs_ = NowMs();
  sender_ = std::thread([this] { SendLoop(); });
}

Connection::~Connection() {
  stop_ = true;
  cut_->Detach();  // sock_ closes after this body
  Fail("engine is shutting down");
  if (sender_.joinable()) sender_.join();
  if (receiver_.joinable()) receiver_.join();
}

void Connection::Resolve(const FramePtr& f, StatusCode code, const std::string& message) {
  // Caller holds no lock; `resolved` was claimed under mu_.
  outstanding_.fetch_sub(1);
  f->xfer->PartDone(code, message);
}

bool Connection::Enqueue(FramePtr frame) {
  outstanding_.fetch_add(1);
  const TcpTransfer& x = *frame->xfer;
  // Small CPU frames go out from the caller's thread when the socket is idle.
  const bool eligible = frame->bytes <= kInlineSendBytes &&
                        (frame->isRead || x.localLoc != MemoryLocationType::GPU);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (retired_) {
      outstanding_.fetch_sub(1);
      return false;
    }
    if (broken_) {
      frame->resolved = true;
    } else if (!(eligible && dialed_ && !senderBusy_ && !handoff_ && queue_.empty())) {
      if (outstanding_.load() == 1) lastProgressMs_ = NowMs();
      queue_.push_back(std::move(frame));
      cv_.notify_one();
      return true;
    } else {
      if (outstanding_.load() == 1) lastProgressMs_ = NowMs();
      senderBusy_ = true;
      frame->requestId = nextRequestId_++;
      frame->busy++;
      inflight_.push_back(frame);  // before sending: the reply may beat sendmsg's return
    }
  }
  if (frame->resolved) {
    Resolve(frame, StatusCode::ERR_BAD_STATE, failReason_);
    return true;
  }
  Prepare(*frame);
  std::string err;
  int r = sock_.SendVNow(frame->iov, &frame->iovIdx, &err);
  if (r == 0) {  // socket full: the sender thread finishes this frame, token included
    std::lock_guard<std::mutex> lock(mu_);
    handoff_ = std::move(frame);
    cv_.notify_one();
    return true;
  }
  AfterSend(frame, r == 1, err);
  return true;
}

void Connection::Fail(const std::string& reason) {
  std::vector<FramePtr> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_) {
      broken_ = true;
      const std::string why =
          cut_->IsCut() ? "cut because the local memory of a transfer on it was deregistered" : reason;
      failReason_ = "TCP connection " + std::to_string(index_) + " to engine '" + target_.remote.key + "' (" +
                    target_.remote.host + ":" + std::to_string(target_.remote.port) + ") failed: " + why;
      bool busy = !queue_.empty() || !inflight_.empty();
      if (stop_ || retired_) {
        MORI_DEBUG(failReason_);
      } else if (busy) {
        MORI_WARN(failReason_);
      } else {
        MORI_INFO(failReason_);
      }
      sock_.Shutdown();
    }
    for (auto* q : {&queue_, &inflight_})
      for (auto& f : *q)
        if (!f->resolved && f->busy == 0) {
          f->resolved = true;
          victims.push_back(f);
        }
    queue_.clear();
    // Frames a socket thread is still moving stay; that thread resolves them.
    std::deque<FramePtr> keep;
    for (auto& f : inflight_)
      if (!f->resolved) keep.push_back(f);
    inflight_.swap(keep);
  }
  cv_.notify_all();
  for (auto& f : victims) Resolve(f, StatusCode::ERR_BAD_STATE, failReason_);
}

void Connection::SendLoop() {
  try {
    net::SessionKeys keys;
    net::Socket s = net::Dial(target_.remote.host, target_.remote.port, net::Channel::TcpData, target_.handshake,
                              target_.remote.key, target_.config.connectTimeoutMs, &keys, &broken_);
    s.ConfigureForBulk(target_.config.sockBufBytes, target_.config.opTimeoutMs);
    txMac_ = keys.ForSending(true);
    rxMac_ = keys.ForReceiving(true);
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return;
    sock_ = std::move(s);
    dialed_ = true;
    if (!cut_->SetFd(sock_.fd())) throw BadState("cut before it was used");
  } catch (const std::exception& e) {
    Fail(e.what());
    return;
  }
  receiver_ = std::thread([this] { RecvLoop(); });
  while (true) {
    FramePtr f;
    bool resumed = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return broken_ || handoff_ || (!queue_.empty() && !senderBusy_); });
      if (handoff_) {
        f = std::move(handoff_);
        resumed = true;  // the send token came with it
      } else if (broken_) {
        return;
      } else {
        f = std::move(queue_.front());
        queue_.pop_front();
        senderBusy_ = true;
        f->requestId = nextRequestId_++;
        f->busy++;
        inflight_.push_back(f);  // before sending: the reply may beat sendmsg's return
      }
    }
    if (!resumed) Prepare(*f);
    std::string err;
    bool ok = !broken_ && SendRest(*f, &err);
    if (!ok && err.empty()) err = "connection closed";
    AfterSend(f, ok, err);
    if (!ok) return;
  }
}

void Connection::AfterSend(const FramePtr& f, bool ok, const std::string& err) {
  bool resolveHere = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    senderBusy_ = false;
    f->busy--;
    // The reply may already be in (it can beat sendmsg's return); if so, or
    // if the connection broke meanwhile, this thread finishes the frame.
    if (!f->resolved && f->busy == 0 && (f->hasOutcome || broken_ || !ok)) {
      f->resolved = true;
      resolveHere = true;
    }
    if (!queue_.empty()) cv_.notify_one();
  }
  if (ok) lastProgressMs_ = NowMs();
  if (!ok) Fail(err);
  if (resolveHere) {
    if (f->hasOutcome) Resolve(f, f->outcome, f->outcomeMessage);
    else Resolve(f, StatusCode::ERR_BAD_STATE, failReason_);
  }
}

void Connection::Prepare(Frame& f) {
  RequestHeader& h = f.header;
  h.magic = kFrameMagic;
  h.op = static_cast<uint8_t>(f.isRead ? Op::Read : Op::Write);
  h.flags = f.notifyTotal ? kFlagNotify : 0;
  h.memId = f.remoteMemId;
  h.numSegments = static_cast<uint32_t>(f.segments.size());
  h.requestId = f.requestId;
  h.uid = f.uid;
  h.totalBytes = f.bytes;
  h.notifyTotal = f.notifyTotal;
  f.table.resize(f.segments.size());
  for (size_t i = 0; i < f.segments.size(); ++i) f.table[i] = {f.segments[i].remoteOffset, f.segments[i].size};
  SignRequest(txMac_, h, f.table.data(), f.table.size() * sizeof(WireSegment));
  const TcpTransfer& x = *f.xfer;
  f.iov.clear();
  f.iov.reserve(2 + (f.isRead ? 0 : f.segments.size()));
  f.iov.push_back({&f.header, sizeof(f.header)});
  f.iov.push_back({f.table.data(), f.table.size() * sizeof(WireSegment)});
  if (!f.isRead && x.localLoc != MemoryLocationType::GPU)
    for (const auto& s : f.segments) f.iov.push_back({x.localBase + s.localOffset, s.size});
  f.iovIdx = 0;
}

bool Connection::SendRest(Frame& f, std::string* err) {
  const int64_t t = target_.config.opTimeoutMs;
  if (f.iovIdx < f.iov.size() && !sock_.SendV(f.iov.data() + f.iovIdx, f.iov.size() - f.iovIdx, t, err)) return false;
  f.iovIdx = f.iov.size();
  const TcpTransfer& x = *f.xfer;
  if (!f.isRead && x.localLoc == MemoryLocationType::GPU)
    return txStager_.SendFromDevice(sock_, x.localDevice, x.localBase, LocalRanges(f.segments), t, err);
  return true;
}

bool Connection::WaitForReply(std::string* err) {
  // Idle time does not count: the clock runs only while requests are outstanding.
  const int64_t idleTimeout = target_.handshake.idleTimeoutMs;
  int64_t idleSince = NowMs();
  while (true) {
    struct pollfd p{sock_.fd(), POLLIN, 0};
    int r = ::poll(&p, 1, 100);
    if (r > 0) return true;
    if (broken_) {
      *err = "closed";
      return false;
    }
    int64_t now = NowMs();
    if (outstanding_.load() == 0) {
      lastProgressMs_ = now;
      // Retire before the target's idle timeout could close it under a new request.
      if (idleTimeout > 0 && now - idleSince > idleTimeout / 2) {
        std::lock_guard<std::mutex> lock(mu_);
        if (outstanding_.load() == 0 && queue_.empty() && inflight_.empty() && !handoff_ && !senderBusy_) {
          retired_ = true;
          *err = "idle, retired";
          return false;
        }
      }
    } else if (now - lastProgressMs_.load() > target_.config.opTimeoutMs) {
      *err = "no reply for " + std::to_string(target_.config.opTimeoutMs) +
             " ms (peer stalled; raise TcpBackendConfig.op_timeout_ms for slow links)";
      return false;
    }
  }
}

bool Connection::ReceiveReply(std::string* err) {
  const int64_t t = target_.config.opTimeoutMs;
  ReplyHeader h{};
  if (!sock_.RecvAll(&h, sizeof(h), t, err)) return false;
  lastProgressMs_ = NowMs();
  if (h.magic != kFrameMagic || h.kind < 1 || h.kind > 3 || h.messageLen > kMaxReplyMessage) {
    // Nothing of a malformed reply is used; the connection ends.
    *err = "malformed reply from peer";
    return false;
  }
  FramePtr f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (inflight_.empty() || inflight_.front()->requestId != h.requestId) {
      *err = "reply for unknown request " + std::to_string(h.requestId);
      return false;
    }
    f = inflight_.front();
    f->busy++;
  }
  std::string message(h.messageLen, '\0');
  bool ok = sock_.RecvAll(message.data(), message.size(), t, err);
  if (ok && !VerifyReply(rxMac_, h, message.data(), message.size())) {
    *err = "reply failed authentication (not from the engine that completed the handshake)";
    ok = false;
  }
  StatusCode code = StatusCode::SUCCESS;
  std::string text;
  auto kind = static_cast<ReplyKind>(h.kind);
  if (ok) {
    if (kind == ReplyKind::Error) {
      code = IsError(static_cast<StatusCode>(h.code)) ? static_cast<StatusCode>(h.code) : StatusCode::ERR_BAD_STATE;
      text = "engine '" + target_.remote.key + "' refused the transfer: " + message;
    } else if (kind == ReplyKind::Ack) {
      if (f->isRead) {
        *err = "write acknowledgement for a read request";
        ok = false;
      }
    } else {  // ReadData
      if (!f->isRead || h.dataBytes != f->bytes) {
        *err = "read reply of " + std::to_string(h.dataBytes) + " bytes, expected " + std::to_string(f->bytes);
        ok = false;
      } else {
        const TcpTransfer& x = *f->xfer;
        if (x.localLoc == MemoryLocationType::GPU) {
          ok = rxStager_.RecvToDevice(sock_, x.localDevice, x.localBase, LocalRanges(f->segments), t, err);
        } else {
          std::vector<struct iovec> iov;
          iov.reserve(f->segments.size());
          for (const auto& s : f->segments) iov.push_back({x.localBase + s.localOffset, s.size});
          ok = sock_.RecvV(iov.data(), iov.size(), t, err);
        }
      }
    }
  }
  if (!ok) {
    code = StatusCode::ERR_BAD_STATE;
    if (cut_->IsCut()) *err = "cut because the local memory of a transfer on it was deregistered";
    text = "TCP transfer to engine '" + target_.remote.key + "' failed: " + *err;
  }
  bool resolveHere = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    f->busy--;
    f->hasOutcome = true;
    f->outcome = code;
    f->outcomeMessage = text;
    if (!f->resolved && f->busy == 0) {
      f->resolved = true;
      resolveHere = true;
    }
    if (!inflight_.empty() && inflight_.front() == f) inflight_.pop_front();
  }
  lastProgressMs_ = NowMs();
  if (resolveHere) Resolve(f, code, text);
  return ok;
}

void Connection::RecvLoop() {
  std::string err;
  while (true) {
    if (!WaitForReply(&err) || !ReceiveReply(&err)) break;
  }
  Fail(err);
}

// ------------------------------------------------------------------- PeerLink
PeerLink::PeerLink(LinkTarget target)
    : target_(std::move(target)),
      heartbeat_(target_, [this] { return Busy(); }, [this](const std::string& why) { AbortAll(why); }) {
  std::lock_guard<std::mutex> lock(mu_);
  conns_.resize(static_cast<size_t>(std::max(1, target_.config.numConnections)));
}

bool PeerLink::Busy() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : conns_)
    if (c && !c->Broken() && c->Outstanding() > 0) return true;
  return false;
}

void PeerLink::AbortAll(const std::string& reason) {
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns = conns_;
  }
  for (auto& c : conns)
    if (c) c->Abort(reason);
}

PeerLink::~PeerLink() { Close(); }

void PeerLink::Close() {
  alive_ = false;
  std::vector<std::shared_ptr<Connection>> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old.swap(conns_);
    conns_.resize(old.size());
  }
  old.clear();  // joins the connections' threads, failing what they held
}

std::shared_ptr<Connection> PeerLink::ConnectionAt(size_t i) {
  std::shared_ptr<Connection> stale;
  std::lock_guard<std::mutex> lock(mu_);
  auto& c = conns_[i % conns_.size()];
  if (!c || c->Broken()) {  // broken or retired as idle
    stale = std::move(c);
    c = std::make_shared<Connection>(target_, static_cast<int>(i % conns_.size()));
  }
  return c;
  // `stale` (if any) is released after the lock: its threads have already stopped.
}

void PeerLink::Submit(const std::shared_ptr<TcpTransfer>& xfer, uint32_t remoteMemId, const SegmentList& segments,
                      TransferUniqueId uid, bool isRead) {
  uint64_t total = TotalBytes(segments);
  std::vector<SegmentList> plans = PlanFrames(segments, ChooseFrameBytes(total, target_.config));
  if (plans.empty()) {  // nothing to move (all segments empty)
    xfer->status->Update(StatusCode::SUCCESS);
    return;
  }
  xfer->remaining = static_cast<uint32_t>(plans.size());
  uint32_t notifyTotal = target_.config.enableNotification ? static_cast<uint32_t>(plans.size()) : 0;
  size_t start = rr_.fetch_add(plans.size());
  std::vector<std::shared_ptr<Connection>> conns(plans.size());
  for (size_t i = 0; i < plans.size(); ++i) {
    conns[i] = ConnectionAt(start + i);
    // Before any frame can finish (and release the pin): deregistering the
    // local region cuts the connections that move its bytes.
    xfer->localPin.Attach(conns[i]->cut());
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    auto f = std::make_shared<Frame>();
    f->xfer = xfer;
    f->isRead = isRead;
    f->remoteMemId = remoteMemId;
    f->uid = uid;
    f->notifyTotal = notifyTotal;
    f->bytes = TotalBytes(plans[i]);
    f->segments = std::move(plans[i]);
    // A connection that retired itself as idle meanwhile takes nothing: use a fresh one.
    for (auto c = conns[i]; !c->Enqueue(f);) {
      c = ConnectionAt(start + i);
      xfer->localPin.Attach(c->cut());
    }
  }
  heartbeat_.Kick();
}

}  // namespace mori::io::tcp
