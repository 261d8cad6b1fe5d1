#include "io/rdma/control_server.hpp"

#include <poll.h>

#include <cerrno>

#include <map>
#include <vector>

#include "common/logging.hpp"
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
  while (!stopping.load() && !core->Closed()) {
    // Idle peers are fine: wait in short slices so shutdown is noticed.
    struct pollfd p{sock.fd(), POLLIN, 0};
    int r = ::poll(&p, 1, 200);
    if (r == 0) continue;
    if (r < 0 && errno == EINTR) continue;
    uint32_t n = 0;
    if (r < 0 || !sock.RecvAll(&n, sizeof(n), t, &err)) break;
    if (n > kMaxControlBytes) {
      MORI_WARN(who << ": dropping connection, message of " << n << " bytes exceeds " << kMaxControlBytes);
      break;
    }
    body.resize(n);
    if (!sock.RecvAll(body.data(), n, t, &err)) break;
    std::vector<uint8_t> reply;
    try {
      reply = core->Serve(peer.engineKey, body, &groups);
    } catch (const std::exception& e) {
      MORI_WARN(who << ": dropping connection, malformed request (" << e.what() << ")");
      break;
    }
    uint32_t rn = static_cast<uint32_t>(reply.size());
    struct iovec iov[2] = {{&rn, sizeof(rn)}, {reply.data(), reply.size()}};
    if (!sock.SendV(iov, 2, t, &err)) break;
  }
  if (!groups.empty())
    MORI_INFO(who << " closed; freeing " << groups.size() << " queue-pair group(s)"
                  << (err.empty() || err == "connection closed by peer" ? "" : ": " + err));
}

}  // namespace mori::io::rdma
