#include "io/rdma/control_server.hpp"

#include <map>
#include <vector>

#include "common/logging.hpp"
#include "io/net/log_limiter.hpp"
#include "io/rdma/control_protocol.hpp"
#include "io/rdma/rdma_core.hpp"

namespace mori::io::rdma {

namespace {

class ControlSession : public net::ChannelSession {
 public:
  ControlSession(const std::shared_ptr<RdmaCore>& core, const net::PeerHello& peer)
      : core_(core),
        key_(peer.engineKey),
        address_(peer.address),
        who_("RDMA control channel from engine '" + peer.engineKey + "'"),
        rx_(peer.keys.ForReceiving(false)),
        tx_(peer.keys.ForSending(false)) {}

  ~ControlSession() override {
    if (!groups_.empty())
      MORI_INFO(who_ << " closed; freeing " << groups_.size() << " queue-pair group(s)"
                     << (err_.empty() || err_ == "connection closed by peer" ? "" : ": " + err_));
  }

  bool OnReadable(net::Socket& sock, const std::atomic<bool>& stopping) override {
    if (core_->Closed()) return false;
    const int64_t t = core_->settings.controlTimeoutMs;
    if (!net::RecvAuthedMsg(sock, rx_, n_, &body_, kMaxControlBytes, t, &err_, &stopping)) {
      if (err_.find("exceeds") != std::string::npos || err_.find("authentication") != std::string::npos)
        MORI_WARN_REMOTE(address_, who_ << ": dropping connection: " << err_);
      return false;
    }
    std::vector<uint8_t> reply;
    try {
      reply = core_->Serve(key_, body_, &groups_);
    } catch (const std::exception& e) {
      MORI_WARN_REMOTE(address_, who_ << ": dropping connection, malformed request (" << e.what() << ")");
      return false;
    }
    if (!net::SendAuthedMsg(sock, tx_, n_, reply.data(), static_cast<uint32_t>(reply.size()), t, &err_)) return false;
    ++n_;
    return true;
  }

  // Queue-pair groups live as long as this connection, however quiet the peer.
  bool ClosesWhenIdle() const override { return false; }
  bool Ended() const override { return core_->Closed(); }

 private:
  std::shared_ptr<RdmaCore> core_;
  const std::string key_, address_, who_;
  net::FrameMac rx_, tx_;
  std::map<uint64_t, GroupPtr> groups_;
  std::vector<uint8_t> body_;
  std::string err_;
  uint64_t n_ = 0;  // messages on this connection: the tags' counter
};

}  // namespace

std::unique_ptr<net::ChannelSession> NewControlSession(const std::shared_ptr<RdmaCore>& core, net::Socket&,
                                                       const net::PeerHello& peer) {
  return std::make_unique<ControlSession>(core, peer);
}

}  // namespace mori::io::rdma
