#include "io/rdma/control_server.hpp"

#include <poll.h>

#include <cerrno>

#include <map>
#include <vector>

#include "common/logging.hpp"
#include "io/net/log_limiter.hpp"
#include "io/rdma/control_protocol.hpp"
#include "io/rdma/rdma_core.hpp"

namespace mori::io::rdma {

void ServeControlChannel(const std::shared_ptr<RdmaCore>& core, net::Socket& sock, const net::PeerHello& peer,
                         const std::atomic<bool>& stopping) {
  const std::string who = "RDMA control channel from engine '" + peer.engineKey + "'";
  const int64_t t = core->settings.controlTimeoutMs;
  std::map<uint64_t, GroupPtr> groups;
  std::string err;
  std::vector<uint8_t> body;
  net::FrameMac rx = peer.keys.ForReceiving(false), tx = peer.keys.ForSending(false);
  uint64_t n = 0;  // messages on this connection: the tags' counter
  while (!stopping.load() && !core->Closed()) {
    // Idle peers are fine (queue-pair groups live as long as this connection):
    // wait in short slices so shutdown is noticed.
    struct pollfd p{sock.fd(), POLLIN, 0};
    int r = ::poll(&p, 1, 200);
    if (r == 0 || (r < 0 && errno == EINTR)) continue;
    if (r < 0 || !net::RecvAuthedMsg(sock, rx, n, &body, kMaxControlBytes, t, &err)) {
      if (err.find("exceeds") != std::string::npos || err.find("authentication") != std::string::npos)
        MORI_WARN_REMOTE(peer.address, who << ": dropping connection: " << err);
      break;
    }
    std::vector<uint8_t> reply;
    try {
      reply = core->Serve(peer.engineKey, body, &groups);
    } catch (const std::exception& e) {
      MORI_WARN_REMOTE(peer.address, who << ": dropping connection, malformed request (" << e.what() << ")");
      break;
    }
    if (!net::SendAuthedMsg(sock, tx, n, reply.data(), static_cast<uint32_t>(reply.size()), t, &err)) break;
    ++n;
  }
  if (!groups.empty())
    MORI_INFO(who << " closed; freeing " << groups.size() << " queue-pair group(s)"
                  << (err.empty() || err == "connection closed by peer" ? "" : ": " + err));
}

}  // namespace mori::io::rdma
