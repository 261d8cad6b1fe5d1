// The control plane's handshake (protocol 2):
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
// Each message travels as u32 length + body, at most kMaxHandshakeMsgBytes.
// The whole exchange is bounded by one deadline (HandshakeOptions.timeoutMs)
// on each side, however the peer spreads its bytes over the phases.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "io/net/channel.hpp"

namespace mori::io::net {

// Largest handshake message either side accepts (a ClientProof with a
// 512-byte key is 552 bytes): all a peer can make the listener hold before it
// is authenticated.
constexpr uint32_t kMaxHandshakeMsgBytes = 1024;

// Connects to a peer's listener and performs the client side of the
// handshake within opts.timeoutMs in total (after a connect bounded by
// connectTimeoutMs). When `expectedKey` is non-empty the peer must present
// that engine key (a restarted peer on a reused port is refused). `keys`,
// when given, receives the connection's frame keys. `stop`, when given and
// set, abandons the handshake early. Throws mori::BadState.
Socket Dial(const std::string& host, uint16_t port, Channel channel, const HandshakeOptions& opts,
            const std::string& expectedKey, int64_t connectTimeoutMs, SessionKeys* keys = nullptr,
            const std::atomic<bool>* stop = nullptr);

// The server side of the handshake on one connection, driven by readiness:
// Advance() takes what has arrived without blocking and answers when a
// message is complete. The caller enforces the deadline.
class ServerHandshake {
 public:
  enum class Result { Pending, Accepted, Failed };

  ServerHandshake(const HandshakeOptions& opts, std::string address);
  // Reads and answers what the peer sent so far. Accepted: peer() is filled
  // and the socket holds nothing of the handshake any more. Failed: error().
  Result Advance(Socket& sock);
  const std::string& error() const { return error_; }
  PeerHello& peer() { return peer_; }
  // Which message it waits for (log lines about a timeout).
  const char* waitingFor() const;

 private:
  enum class Phase : uint8_t { Hello, Proof, Done };
  // Reads the current message; true with *complete once its body is whole.
  bool ReadMessage(Socket& sock, bool* complete);
  bool OnClientHello(Socket& sock);
  bool OnClientProof(Socket& sock);
  bool Fail(const std::string& why);

  const HandshakeOptions& opts_;
  Phase phase_ = Phase::Hello;
  uint8_t lenBytes_ = 0;
  uint8_t lenBuf_[4] = {0, 0, 0, 0};
  uint32_t got_ = 0;
  std::vector<uint8_t> body_;
  Nonce clientNonce_{};
  Nonce serverNonce_{};
  PeerHello peer_;
  std::string error_;
};

}  // namespace mori::io::net
