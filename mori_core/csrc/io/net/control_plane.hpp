// The engine's control plane: one TCP listener per engine, shared by every
// backend that talks over the network (see listener.hpp), the handshake every
// connection starts with (handshake.hpp), and the message framing of the
// message-oriented channels.
//
// After the handshake a connection belongs to the session its channel's
// handler made: the TCP backend's data channel, the RDMA backend's queue-pair
// exchange, the engine's notification channel, or the listener's own
// heartbeat echo.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/net/auth.hpp"
#include "io/net/channel.hpp"
#include "io/net/handshake.hpp"
#include "io/net/listener.hpp"
#include "io/net/socket.hpp"

namespace mori::io::net {

// Serves Channel::Heartbeat: echoes each authenticated 8-byte ping.
std::unique_ptr<ChannelSession> NewHeartbeatSession(Socket& sock, const PeerHello& peer);

// Message framing of the message-oriented channels (heartbeat, RDMA control):
// u32 length | body | tag (16 bytes, only when `mac` is keyed). `counter` is
// this direction's message count, kept in step by both sides.
bool SendAuthedMsg(Socket& s, FrameMac& mac, uint64_t counter, const void* body, uint32_t n, int64_t timeoutMs,
                   std::string* err);
// Receives one message of at most maxBytes into *body; false with *err on a
// bad length, a bad tag or a socket error.
bool RecvAuthedMsg(Socket& s, FrameMac& mac, uint64_t counter, std::vector<uint8_t>* body, uint32_t maxBytes,
                   int64_t timeoutMs, std::string* err, const std::atomic<bool>* stop = nullptr);

}  // namespace mori::io::net
