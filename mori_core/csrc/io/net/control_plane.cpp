#include "io/net/control_plane.hpp"

#include "common/logging.hpp"
#include "io/net/log_limiter.hpp"

namespace mori::io::net {
namespace {

constexpr uint32_t kHeartbeatBytes = 8;
// A ping's bytes arrive together; this bounds a peer that sends half of one.
constexpr int64_t kHeartbeatMsgTimeoutMs = 5000;

class HeartbeatSession : public ChannelSession {
 public:
  explicit HeartbeatSession(const PeerHello& peer)
      : address_(peer.address), rx_(peer.keys.ForReceiving(false)), tx_(peer.keys.ForSending(false)) {}

  bool OnReadable(Socket& sock, const std::atomic<bool>& stopping) override {
    std::string err;
    bool ok = RecvAuthedMsg(sock, rx_, count_, &ping_, kHeartbeatBytes, kHeartbeatMsgTimeoutMs, &err, &stopping) &&
              SendAuthedMsg(sock, tx_, count_, ping_.data(), static_cast<uint32_t>(ping_.size()),
                            kHeartbeatMsgTimeoutMs, &err);
    ++count_;
    if (!ok && !stopping.load() && err.find("authentication") != std::string::npos)
      MORI_WARN_REMOTE(address_, "heartbeat channel from " << address_ << ": " << err);
    return ok;
  }
  bool Urgent() const override { return true; }

 private:
  std::string address_;
  FrameMac rx_, tx_;
  uint64_t count_ = 0;
  std::vector<uint8_t> ping_;
};

}  // namespace

std::unique_ptr<ChannelSession> NewHeartbeatSession(Socket&, const PeerHello& peer) {
  return std::make_unique<HeartbeatSession>(peer);
}

// ------------------------------------------------------ authenticated messages
bool SendAuthedMsg(Socket& s, FrameMac& mac, uint64_t counter, const void* body, uint32_t n, int64_t timeoutMs,
                   std::string* err) {
  Tag tag = mac.Sign(counter, {{&n, sizeof(n)}, {body, n}});
  struct iovec iov[3] = {{&n, sizeof(n)}, {const_cast<void*>(body), n}, {tag.data(), tag.size()}};
  return s.SendV(iov, mac.enabled() ? 3 : 2, timeoutMs, err);
}

bool RecvAuthedMsg(Socket& s, FrameMac& mac, uint64_t counter, std::vector<uint8_t>* body, uint32_t maxBytes,
                   int64_t timeoutMs, std::string* err, const std::atomic<bool>* stop) {
  uint32_t n = 0;
  if (!s.RecvAll(&n, sizeof(n), timeoutMs, err, stop)) return false;
  if (n > maxBytes) {
    *err = "message of " + std::to_string(n) + " bytes exceeds " + std::to_string(maxBytes);
    return false;
  }
  body->resize(n);
  if (!s.RecvAll(body->data(), n, timeoutMs, err)) return false;
  if (!mac.enabled()) return true;
  Tag tag{};
  if (!s.RecvAll(tag.data(), tag.size(), timeoutMs, err)) return false;
  if (!mac.Verify(counter, {{&n, sizeof(n)}, {body->data(), n}}, tag)) {
    *err = "message failed authentication (not from the peer that completed the handshake)";
    return false;
  }
  return true;
}

}  // namespace mori::io::net
