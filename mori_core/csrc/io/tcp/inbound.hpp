// Target side of the TCP data channel: serves one authenticated connection.
#pragma once

#include <memory>

#include "io/common.hpp"
#include "io/engine_context.hpp"
#include "io/net/control_plane.hpp"

namespace mori::io::tcp {

// The session of one authenticated data-channel connection: each request is
// checked (header tag, request id, every range against the registered region)
// before a byte is read or written; a malformed one is logged and ends the
// connection.
std::unique_ptr<net::ChannelSession> NewDataChannelSession(EngineContext& ctx, const TcpBackendConfig& cfg,
                                                           net::Socket& sock, const net::PeerHello& peer);

}  // namespace mori::io::tcp
