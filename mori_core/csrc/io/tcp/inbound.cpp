#include "io/tcp/inbound.hpp"

#include <vector>

#include "common/logging.hpp"
#include "io/net/log_limiter.hpp"
#include "io/segments.hpp"
#include "io/tcp/gpu_staging.hpp"
#include "io/tcp/wire.hpp"

namespace mori::io::tcp {
namespace {

bool SendReply(net::Socket& sock, net::FrameMac& mac, ReplyKind kind, StatusCode code, uint64_t requestId,
               const std::string& message, uint64_t dataBytes, int64_t timeoutMs, std::string* err) {
  std::string msg = message.substr(0, kMaxReplyMessage);
  ReplyHeader r{};
  r.magic = kFrameMagic;
  r.kind = static_cast<uint8_t>(kind);
  r.code = static_cast<uint8_t>(code);
  r.messageLen = static_cast<uint16_t>(msg.size());
  r.requestId = requestId;
  r.dataBytes = dataBytes;
  SignReply(mac, r, msg.data(), msg.size());
  struct iovec iov[2] = {{&r, sizeof(r)}, {msg.data(), msg.size()}};
  return sock.SendV(iov, 2, timeoutMs, err);
}

// Serves the requests of one connection, one per OnReadable.
class DataChannelSession : public net::ChannelSession {
 public:
  DataChannelSession(EngineContext& ctx, const TcpBackendConfig& cfg, net::Socket& sock, const net::PeerHello& peer)
      : ctx_(ctx),
        t_(cfg.opTimeoutMs),
        key_(peer.engineKey),
        address_(peer.address),
        who_("TCP data channel from engine '" + peer.engineKey + "' (" + peer.address + ")"),
        rx_(peer.keys.ForReceiving(false)),
        tx_(peer.keys.ForSending(false)),
        cut_(std::make_shared<CutHandle>(sock.fd())),
        stager_(cfg.stagingBytes) {
    sock.ConfigureForBulk(cfg.sockBufBytes, cfg.opTimeoutMs);
  }

  // Forgets the socket in the cut handle before the listener closes it.
  ~DataChannelSession() override {
    cut_->Detach();
    if (cut_->IsCut())
      MORI_INFO(who_ << " cut: a region it was moving bytes of was deregistered");
    else if (!err_.empty() && err_ != "connection closed by peer")
      MORI_INFO(who_ << " closed: " << err_);
  }

  bool OnReadable(net::Socket& sock, const std::atomic<bool>& stopping) override;

 private:
  bool Refuse(net::Socket& sock, const RequestHeader& h, StatusCode code, const std::string& why);

  EngineContext& ctx_;
  const int64_t t_;
  const std::string key_, address_, who_;
  net::FrameMac rx_, tx_;
  CutPtr cut_;  // deregistration of a region this connection moves bytes of cuts it
  uint64_t expectedId_ = 1;
  DeviceStager stager_;
  std::vector<WireSegment> table_;
  std::vector<struct iovec> iov_;
  std::vector<ByteRange> ranges_;
  std::string err_;
};

bool DataChannelSession::Refuse(net::Socket& sock, const RequestHeader& h, StatusCode code, const std::string& why) {
  MORI_INFO(who_ << ": refused request " << h.requestId << ": " << why);
  if (h.op == static_cast<uint8_t>(Op::Write) && !sock.Discard(h.totalBytes, t_, &err_)) return false;
  return SendReply(sock, tx_, ReplyKind::Error, code, h.requestId, why, 0, t_, &err_);
}

bool DataChannelSession::OnReadable(net::Socket& sock, const std::atomic<bool>& stopping) {
  // The request's first bytes are there: the rest must follow promptly.
  RequestHeader h{};
  if (!sock.RecvAll(&h, sizeof(h), t_, &err_, &stopping)) return false;
  std::string bad = ValidateRequestHeader(h);
  if (bad.empty() && h.requestId != expectedId_)
    bad = "request id " + std::to_string(h.requestId) + ", expected " + std::to_string(expectedId_);
  if (!bad.empty()) {
    MORI_WARN_REMOTE(address_, who_ << ": dropping connection, malformed request (" << bad << ")");
    return false;
  }
  table_.resize(h.numSegments);
  if (!sock.RecvAll(table_.data(), table_.size() * sizeof(WireSegment), t_, &err_)) return false;
  if (!VerifyRequest(rx_, h, table_.data(), table_.size() * sizeof(WireSegment))) {
    MORI_WARN_REMOTE(address_, who_ << ": dropping connection, request " << h.requestId
                                    << " failed authentication (not from the engine that completed the "
                                       "handshake: a relayed or injected frame)");
    return false;
  }
  ++expectedId_;
  uint64_t sum = 0;
  bool overflow = false;
  for (const auto& s : table_) {
    if (s.size > kMaxFrameBytes) overflow = true;
    sum += s.size;
  }
  if (overflow || sum != h.totalBytes) {
    MORI_WARN_REMOTE(address_, who_ << ": dropping connection, segment sizes do not add up to the frame payload");
    return false;
  }

  const bool isWrite = h.op == static_cast<uint8_t>(Op::Write);
  RegionPin pin = ctx_.memory.Pin(h.memId);
  if (!pin)
    return Refuse(sock, h, StatusCode::ERR_NOT_FOUND,
                  "memory id " + std::to_string(h.memId) + " is not registered on engine '" + ctx_.key + "'");
  for (size_t i = 0; i < table_.size(); ++i) {
    std::string e = CheckRangeInRegion(table_[i].offset, table_[i].size, pin.desc().size);
    if (!e.empty()) return Refuse(sock, h, StatusCode::ERR_INVALID_ARGS, "segment " + std::to_string(i) + ": " + e);
  }

  pin.Attach(cut_);
  const MemoryDesc& mem = pin.desc();
  uint8_t* base = pin.base();
  const bool onGpu = mem.loc == MemoryLocationType::GPU;
  if (onGpu) {
    ranges_.clear();
    for (const auto& s : table_) ranges_.emplace_back(s.offset, s.size);
  } else {
    iov_.clear();
    for (const auto& s : table_) iov_.push_back({base + s.offset, s.size});
  }
  if (isWrite) {
    bool ok = onGpu ? stager_.RecvToDevice(sock, mem.deviceId, base, ranges_, t_, &err_)
                    : sock.RecvV(iov_.data(), iov_.size(), t_, &err_);
    if (!ok) return false;
    pin = RegionPin();
    // Record before acknowledging: once the initiator sees SUCCESS, the
    // target's pop_inbound_transfer_status already reports it.
    if (h.flags & kFlagNotify) ctx_.notifications.Record(key_, h.uid, h.notifyTotal);
    return SendReply(sock, tx_, ReplyKind::Ack, StatusCode::SUCCESS, h.requestId, "", 0, t_, &err_);
  }
  if (!SendReply(sock, tx_, ReplyKind::ReadData, StatusCode::SUCCESS, h.requestId, "", h.totalBytes, t_, &err_))
    return false;
  bool ok = onGpu ? stager_.SendFromDevice(sock, mem.deviceId, base, ranges_, t_, &err_)
                  : sock.SendV(iov_.data(), iov_.size(), t_, &err_);
  if (!ok) return false;
  pin = RegionPin();
  if (h.flags & kFlagNotify) ctx_.notifications.Record(key_, h.uid, h.notifyTotal);
  return true;
}

}  // namespace

std::unique_ptr<net::ChannelSession> NewDataChannelSession(EngineContext& ctx, const TcpBackendConfig& cfg,
                                                           net::Socket& sock, const net::PeerHello& peer) {
  return std::make_unique<DataChannelSession>(ctx, cfg, sock, peer);
}

}  // namespace mori::io::tcp
