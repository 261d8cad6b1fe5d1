// What the control-plane listener and the backends that serve its channels
// share: the channels, what the handshake established about a peer, the
// handshake's settings, and the interface of a served connection.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "io/net/auth.hpp"
#include "io/net/socket.hpp"

namespace mori::io::net {

enum class Channel : uint8_t { TcpData = 1, RdmaControl = 2, Notify = 3, Heartbeat = 4 };

struct PeerHello {
  std::string engineKey;
  Channel channel;
  SessionKeys keys;           // per-connection frame keys (disabled without a secret)
  std::string address;        // peer IP (log lines)
  int64_t idleTimeoutMs = 0;  // a connection silent for this long may be closed (0 = never)
};

struct HandshakeOptions {
  std::string selfKey;
  std::string secret;  // empty = no authentication
  // The whole handshake, all four messages, must finish within this bound
  // (MORI_IO_CP_TIMEOUT_MS), on both sides.
  int64_t timeoutMs = 5000;
  // Inbound connections with no request for this long are closed by the
  // target (MORI_IO_IDLE_TIMEOUT_MS); initiators close theirs at half of it.
  int64_t idleTimeoutMs = 300000;
};

// What one listener holds at most; see docs/reliability.md (connection floods).
struct ListenerLimits {
  // Connections still in the handshake (unauthenticated). Over the cap the
  // oldest is closed to make room (MORI_IO_MAX_HANDSHAKES).
  size_t maxHandshakes = 1024;
  // Connections past the handshake. Over the cap a newly authenticated one is
  // closed (MORI_IO_MAX_CONNECTIONS).
  size_t maxConnections = 4096;
  // Threads that serve requests; idle connections hold none (MORI_IO_SERVE_THREADS).
  // Heartbeats have two more of their own.
  size_t serveThreads = 64;
};

// One authenticated connection, as a channel serves it. The listener waits
// for the connection to turn readable (no thread is held meanwhile) and then
// calls OnReadable on one of its serving threads; never on two threads at
// once. OnReadable handles one request: it may block within that request,
// bounded by its own timeouts (the peer already spoke first).
class ChannelSession {
 public:
  virtual ~ChannelSession() = default;
  // False ends the connection (the peer closed it, a malformed or
  // unauthenticated message, a socket error). `stopping`: the engine stops.
  virtual bool OnReadable(Socket& sock, const std::atomic<bool>& stopping) = 0;
  // Whether the listener closes the connection after the idle timeout.
  virtual bool ClosesWhenIdle() const { return true; }
  // True when whoever serves the channel is gone (the backend was removed):
  // the listener then closes the connection while it waits.
  virtual bool Ended() const { return false; }
  // Liveness answers (heartbeats): served on threads of their own, so slow
  // transfers holding every serving thread cannot make a live engine look stopped.
  virtual bool Urgent() const { return false; }
};

// Makes the session of a newly authenticated connection (on a serving
// thread); nullptr refuses it.
using ChannelHandler = std::function<std::unique_ptr<ChannelSession>(Socket& sock, const PeerHello& peer)>;

}  // namespace mori::io::net
