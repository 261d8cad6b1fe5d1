// Target side of the RDMA control channel: serves one peer's control
// connection until it closes, the engine stops or the backend is removed.
#pragma once

#include <atomic>
#include <memory>

#include "io/net/control_plane.hpp"

namespace mori::io::rdma {

class RdmaCore;

// The QP groups created for this connection live exactly as long as it does.
void ServeControlChannel(const std::shared_ptr<RdmaCore>& core, net::Socket& sock, const net::PeerHello& peer,
                         const std::atomic<bool>& stopping);

}  // namespace mori::io::rdma
