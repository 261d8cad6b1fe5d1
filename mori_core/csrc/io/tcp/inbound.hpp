// Target side of the TCP data channel: serves one authenticated connection.
#pragma once

#include <atomic>

#include "io/common.hpp"
#include "io/engine_context.hpp"
#include "io/net/control_plane.hpp"

namespace mori::io::tcp {

// Reads requests until the peer closes, the stream turns malformed (logged,
// connection dropped) or the engine stops. Every range is checked against
// the registered region before a byte is read or written.
void ServeDataChannel(EngineContext& ctx, const TcpBackendConfig& cfg, net::Socket& sock, const net::PeerHello& peer,
                      const std::atomic<bool>& stopping);

}  // namespace mori::io::tcp
