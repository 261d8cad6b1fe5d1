// Target side of the RDMA control channel: serves one peer's control
// connection until it closes, the engine stops or the backend is removed.
#pragma once

#include <memory>

#include "io/net/control_plane.hpp"

namespace mori::io::rdma {

class RdmaCore;

// The session of one peer's control connection. The QP groups created for it
// live exactly as long as the connection (idle peers keep theirs); it ends
// when the backend is removed.
std::unique_ptr<net::ChannelSession> NewControlSession(const std::shared_ptr<RdmaCore>& core, net::Socket& sock,
                                                       const net::PeerHello& peer);

}  // namespace mori::io::rdma
