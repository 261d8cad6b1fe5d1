// The engine's control plane: one TCP listener per engine, shared by every
// backend that talks over the network.
//
// A connection starts with a handshake (protocol 2):
//   client -> server  ClientHello  magic, version, channel, client nonce
//   server -> client  ServerHello  magic, version, server nonce
//   client -> server  ClientProof  client key, HMAC(secret, "client" | transcript)
//   server -> client  ServerFinal  verdict; if accepted: server key, HMAC(secret, "server" | transcript)
// where the transcript holds the channel, both nonces and the client key. The
// server reveals its key and proves the secret only to a client that proved
// it first, so an unauthenticated peer learns nothing but "refused" (no key,
// no proof over a challenge of its choosing). Both sides then derive
// per-connection keys from the secret and the transcript (one per direction):
// every frame that follows carries a tag under them, so a relay that forwarded
// an honest engine's handshake holds a connection it cannot use. Without a
// secret nothing is proven and frames carry no tags (see docs/reliability.md).
//
// After the handshake the connection is handed to the handler registered for
// its channel: the TCP backend's data channel, the RDMA backend's queue-pair
// exchange, the engine's notification channel, or the listener's own
// heartbeat echo.
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

#include "io/net/auth.hpp"
#include "io/net/socket.hpp"

namespace mori::io::net {

enum class Channel : uint8_t { TcpData = 1, RdmaControl = 2, Notify = 3, Heartbeat = 4 };

struct PeerHello {
  std::string engineKey;
  Channel channel;
  SessionKeys keys;           // per-connection frame keys (disabled without a secret)
  std::string address;        // peer IP, the unit of log rate limiting
  int64_t idleTimeoutMs = 0;  // a connection silent for this long may be closed (0 = never)
};

// Runs on the connection's own thread until the peer closes or `stopping`.
using ChannelHandler = std::function<void(Socket& sock, const PeerHello& peer, const std::atomic<bool>& stopping)>;

struct HandshakeOptions {
  std::string selfKey;
  std::string secret;  // empty = no authentication
  int64_t timeoutMs = 5000;
  // Inbound connections with no request for this long are closed by the
  // target (MORI_IO_IDLE_TIMEOUT_MS); initiators close theirs at half of it.
  int64_t idleTimeoutMs = 300000;
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
  // Connections (handshaking or served) open right now.
  size_t NumConnections();

 private:
  struct Conn {
    std::thread thread;
    std::atomic<bool> done{false};
    int fd = -1;
  };
  void AcceptLoop();
  void Serve(Conn* conn, Socket sock, const std::string& host);
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
// key (a restarted peer on a reused port is refused). `keys`, when given,
// receives the connection's frame keys. `stop`, when given and set, abandons
// the handshake early. Throws mori::BadState.
Socket Dial(const std::string& host, uint16_t port, Channel channel, const HandshakeOptions& opts,
            const std::string& expectedKey, int64_t connectTimeoutMs, SessionKeys* keys = nullptr,
            const std::atomic<bool>* stop = nullptr);

// Serves Channel::Heartbeat: echoes each authenticated 8-byte ping until the peer closes.
void ServeHeartbeat(Socket& sock, const PeerHello& peer, const std::atomic<bool>& stopping);

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
