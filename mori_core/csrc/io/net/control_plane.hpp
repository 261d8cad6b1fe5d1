// The engine's control plane: one TCP listener per engine, shared by every
// backend that talks over the network.
//
// A connection starts with a handshake (engine keys, the channel it will carry
// and, when a shared secret is configured, an HMAC challenge-response in both
// directions — the secret itself never crosses the wire). After that the
// connection is handed to the handler registered for its channel: the TCP
// backend's data channel, the RDMA backend's queue-pair exchange, or the
// engine's notification channel used by intra-node GPU transfers.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "io/net/socket.hpp"

namespace mori::io::net {

enum class Channel : uint8_t { TcpData = 1, RdmaControl = 2, Notify = 3 };

struct PeerHello {
  std::string engineKey;
  Channel channel;
};

// Runs on the connection's own thread until the peer closes or `stopping`.
using ChannelHandler = std::function<void(Socket& sock, const PeerHello& peer, const std::atomic<bool>& stopping)>;

struct HandshakeOptions {
  std::string selfKey;
  std::string secret;  // empty = no authentication
  int64_t timeoutMs = 5000;
};

class Listener {
 public:
  static constexpr size_t kMaxConnections = 4096;

  Listener(const std::string& host, uint16_t port, HandshakeOptions opts);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  uint16_t port() const { return port_; }
  void SetHandler(Channel channel, ChannelHandler handler);
  void Stop();

 private:
  struct Conn {
    std::thread thread;
    std::atomic<bool> done{false};
    int fd = -1;
  };
  void AcceptLoop();
  void Serve(Conn* conn, Socket sock);
  void ReapFinished();

  HandshakeOptions opts_;
  int listenFd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptThread_;
  std::mutex mu_;
  std::map<Channel, ChannelHandler> handlers_;
  std::list<std::unique_ptr<Conn>> conns_;
};

// Connects to a peer's listener and performs the client side of the
// handshake. When `expectedKey` is non-empty the peer must present that engine
// key (a restarted peer on a reused port is refused). Throws mori::BadState.
Socket Dial(const std::string& host, uint16_t port, Channel channel, const HandshakeOptions& opts,
            const std::string& expectedKey, int64_t connectTimeoutMs);

}  // namespace mori::io::net
