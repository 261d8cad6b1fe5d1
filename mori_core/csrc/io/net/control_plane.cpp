#include "io/net/control_plane.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/byte_codec.hpp"
#include "common/error.hpp"
#include "common/logging.hpp"
#include "io/common.hpp"
#include "io/net/log_limiter.hpp"

namespace mori::io::net {
namespace {

constexpr uint32_t kHelloMagic = 0x4f49524d;  // "MRIO"
// 2: the server proves itself only after the client did; keys and proofs are
// bound to the whole transcript; per-connection frame keys.
constexpr uint16_t kProtocolVersion = 2;
constexpr uint32_t kMaxHandshakeBytes = 4096;
constexpr uint8_t kVerdictAccepted = 1;
constexpr uint32_t kHeartbeatBytes = 8;

// Handshake messages travel as u32 length + body.
bool SendMsg(Socket& s, const std::vector<uint8_t>& body, int64_t timeoutMs, std::string* err) {
  uint32_t n = static_cast<uint32_t>(body.size());
  struct iovec iov[2] = {{&n, sizeof(n)}, {const_cast<uint8_t*>(body.data()), body.size()}};
  return s.SendV(iov, 2, timeoutMs, err);
}

bool RecvMsg(Socket& s, std::vector<uint8_t>* body, int64_t timeoutMs, std::string* err,
             const std::atomic<bool>* stop = nullptr) {
  uint32_t n = 0;
  if (!s.RecvAll(&n, sizeof(n), timeoutMs, err, stop)) return false;
  if (n > kMaxHandshakeBytes) {
    *err = "handshake message of " + std::to_string(n) + " bytes exceeds " + std::to_string(kMaxHandshakeBytes);
    return false;
  }
  body->resize(n);
  return s.RecvAll(body->data(), n, timeoutMs, err, stop);
}

// Everything both sides saw before the proofs: what the proofs and keys bind.
std::string Transcript(Channel channel, const Nonce& clientNonce, const Nonce& serverNonce,
                       const std::string& clientKey) {
  ByteWriter w;
  w.PutString("mori-io/2");
  w.Put<uint8_t>(static_cast<uint8_t>(channel));
  w.PutBytes(clientNonce.data(), clientNonce.size());
  w.PutBytes(serverNonce.data(), serverNonce.size());
  w.PutString(clientKey);
  return std::string(w.bytes().begin(), w.bytes().end());
}

Digest ClientProof(const std::string& secret, const std::string& transcript) {
  if (secret.empty()) return Digest{};
  return HmacSha256(secret, "client" + transcript);
}

Digest ServerProof(const std::string& secret, const std::string& transcript, const std::string& serverKey) {
  if (secret.empty()) return Digest{};
  return HmacSha256(secret, "server" + transcript + serverKey);
}

// HKDF-style: a session secret from the shared secret and the transcript,
// then one key per direction from it.
SessionKeys DeriveKeys(const std::string& secret, const std::string& transcript, const std::string& serverKey) {
  SessionKeys k;
  if (secret.empty()) return k;
  Digest master = HmacSha256(secret, "session" + transcript + serverKey);
  std::string m(master.begin(), master.end());
  k.enabled = true;
  k.clientToServer = HmacSha256(m, "client-to-server");
  k.serverToClient = HmacSha256(m, "server-to-client");
  return k;
}

bool ValidChannel(uint8_t c) { return c >= 1 && c <= 4; }

}  // namespace

// --------------------------------------------------------- rate-limited logs
LogLimiter& RemoteInputLog() {
  static LogLimiter limiter;
  return limiter;
}

std::string SuppressedNote(uint64_t n) {
  return n == 0 ? "" : " (" + std::to_string(n) + " similar events from this peer suppressed)";
}

namespace {
std::string HostOf(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  else if (ss.ss_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof(buf));
  return buf;
}
}  // namespace


// ------------------------------------------------------ authenticated messages
bool SendAuthedMsg(Socket& s, FrameMac& mac, uint64_t counter, const void* body, uint32_t n, int64_t timeoutMs,
                   std::string* err) {
  Tag tag = mac.Sign(counter, {{&n, sizeof(n)}, {body, n}});
  struct iovec iov[3] = {{&n, sizeof(n)}, {const_cast<void*>(body), n}, {tag.data(), tag.size()}};
  return s.SendV(iov, mac.enabled() ? 3 : 2, timeoutMs, err);
}

bool RecvAuthedMsg(Socket& s, FrameMac& mac, uint64_t counter, std::vector<uint8_t>* body, uint32_t maxBytes,
                   int64_t timeoutMs, std::string* err, const std::atomic<bool>* stop) {
  uint32_t n = 0;
  if (!s.RecvAll(&n, sizeof(n), timeoutMs, err, stop)) return false;
  if (n > maxBytes) {
    *err = "message of " + std::to_string(n) + " bytes exceeds " + std::to_string(maxBytes);
    return false;
  }
  body->resize(n);
  if (!s.RecvAll(body->data(), n, timeoutMs, err)) return false;
  if (!mac.enabled()) return true;
  Tag tag{};
  if (!s.RecvAll(tag.data(), tag.size(), timeoutMs, err)) return false;
  if (!mac.Verify(counter, {{&n, sizeof(n)}, {body->data(), n}}, tag)) {
    *err = "message failed authentication (not from the peer that completed the handshake)";
    return false;
  }
  return true;
}

void ServeHeartbeat(Socket& sock, const PeerHello& peer, const std::atomic<bool>& stopping) {
  FrameMac rx = peer.keys.ForReceiving(false), tx = peer.keys.ForSending(false);
  std::vector<uint8_t> ping;
  std::string err;
  for (uint64_t i = 0; !stopping.load(); ++i) {
    const int64_t idle = peer.idleTimeoutMs > 0 ? peer.idleTimeoutMs : -1;
    if (!RecvAuthedMsg(sock, rx, i, &ping, kHeartbeatBytes, idle, &err, &stopping)) break;
    if (!SendAuthedMsg(sock, tx, i, ping.data(), static_cast<uint32_t>(ping.size()), 5000, &err)) break;
  }
  if (!stopping.load() && err.find("authentication") != std::string::npos)
    MORI_WARN_REMOTE(peer.address, "heartbeat channel from " << peer.address << ": " << err);
}

// ------------------------------------------------------------------ Listener
Listener::Listener(const std::string& host, uint16_t port, HandshakeOptions opts) : opts_(std::move(opts)) {
  if (!opts_.secret.empty()) (void)HmacSha256(opts_.secret, "probe");  // fail now if libcrypto is missing
  listenFd_ = ListenTcp(host, port, &port_);
  handlers_[Channel::Heartbeat] = ServeHeartbeat;
  acceptThread_ = std::thread([this] { AcceptLoop(); });
}

Listener::~Listener() { Stop(); }

void Listener::SetHandler(Channel channel, ChannelHandler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  handlers_[channel] = std::move(handler);
}

size_t Listener::NumConnections() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto& c : conns_) n += c->done.load() ? 0 : 1;
  return n;
}

void Listener::Stop() {
  if (stopping_.exchange(true)) return;
  if (acceptThread_.joinable()) acceptThread_.join();
  if (listenFd_ >= 0) ::close(listenFd_);
  std::list<std::unique_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : conns_)
      if (c->fd >= 0) ::shutdown(c->fd, SHUT_RDWR);
    conns.swap(conns_);
  }
  for (auto& c : conns)
    if (c->thread.joinable()) c->thread.join();
}

void Listener::ReapFinished() {
  std::list<std::unique_ptr<Conn>> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if ((*it)->done.load()) {
        finished.push_back(std::move(*it));
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : finished) c->thread.join();
}

void Listener::AcceptLoop() {
  while (!stopping_.load()) {
    struct pollfd p{listenFd_, POLLIN, 0};
    int r = ::poll(&p, 1, 200);
    ReapFinished();
    if (r <= 0) continue;
    struct sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = ::accept4(listenFd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::string host = HostOf(ss);
    std::lock_guard<std::mutex> lock(mu_);
    if (conns_.size() >= kMaxConnections) {
      MORI_WARN_REMOTE("(listener full)", "control plane: refusing connection from "
                                              << host << ", " << kMaxConnections
                                              << " connections already open");
      ::close(fd);
      continue;
    }
    auto conn = std::make_unique<Conn>();
    Conn* raw = conn.get();
    raw->fd = fd;
    conns_.push_back(std::move(conn));
    raw->thread = std::thread([this, raw, fd, host] { Serve(raw, Socket(fd), host); });
  }
}

void Listener::Serve(Conn* conn, Socket sock, const std::string& host) {
  std::string err;
  const int64_t t = opts_.timeoutMs;
  PeerHello peer{};
  peer.address = host;
  peer.idleTimeoutMs = opts_.idleTimeoutMs;
  try {
    // 1. ClientHello: magic, version, channel, nonce.
    std::vector<uint8_t> body;
    if (!RecvMsg(sock, &body, t, &err, &stopping_)) throw BadState("client hello: " + err);
    ByteReader r(body.data(), body.size(), "client hello");
    if (r.Get<uint32_t>() != kHelloMagic) throw BadState("client hello: bad magic (not a MORI-IO peer)");
    uint16_t version = r.Get<uint16_t>();
    if (version != kProtocolVersion)
      throw BadState("client hello: protocol version " + std::to_string(version) + ", expected " +
                     std::to_string(kProtocolVersion));
    uint8_t channel = r.Get<uint8_t>();
    Nonce clientNonce;
    r.GetBytes(clientNonce.data(), clientNonce.size());
    if (!ValidChannel(channel)) throw BadState("client hello: unknown channel " + std::to_string(channel));
    peer.channel = static_cast<Channel>(channel);

    // 2. ServerHello: only a fresh nonce (nothing about this engine yet).
    Nonce serverNonce = RandomNonce();
    ByteWriter w;
    w.Put<uint32_t>(kHelloMagic);
    w.Put<uint16_t>(kProtocolVersion);
    w.PutBytes(serverNonce.data(), serverNonce.size());
    if (!SendMsg(sock, w.bytes(), t, &err)) throw BadState("server hello: " + err);

    // 3. ClientProof; 4. ServerFinal (key and proof only for a client that proved the secret).
    if (!RecvMsg(sock, &body, t, &err, &stopping_)) throw BadState("client proof: " + err);
    ByteReader pr(body.data(), body.size(), "client proof");
    peer.engineKey = pr.GetString(kMaxKeyBytes);
    Digest cp;
    pr.GetBytes(cp.data(), cp.size());
    const std::string transcript = Transcript(peer.channel, clientNonce, serverNonce, peer.engineKey);
    bool ok = opts_.secret.empty() || ConstantTimeEqual(cp, ClientProof(opts_.secret, transcript));
    ByteWriter v;
    v.Put<uint8_t>(ok ? kVerdictAccepted : 0);
    if (ok) {
      v.PutString(opts_.selfKey);
      Digest sp = ServerProof(opts_.secret, transcript, opts_.selfKey);
      v.PutBytes(sp.data(), sp.size());
    }
    (void)SendMsg(sock, v.bytes(), t, &err);
    if (!ok) throw BadState("peer '" + peer.engineKey + "' failed authentication (wrong or missing secret)");
    peer.keys = DeriveKeys(opts_.secret, transcript, opts_.selfKey);
  } catch (const std::exception& e) {
    if (!stopping_.load())
      MORI_WARN_REMOTE(peer.address, "control plane: dropped connection from " << peer.address
                                                                               << " during handshake: " << e.what());
    conn->done.store(true);
    return;
  }

  ChannelHandler handler;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handlers_.find(peer.channel);
    if (it != handlers_.end()) handler = it->second;
  }
  if (!handler) {
    MORI_WARN_REMOTE(peer.address, "control plane: no backend serves channel " << static_cast<int>(peer.channel)
                                                                             << " requested by '" << peer.engineKey
                                                                             << "'");
  } else {
    try {
      handler(sock, peer, stopping_);
    } catch (const std::exception& e) {
      MORI_WARN_REMOTE(peer.address, "control plane: connection from '" << peer.engineKey << "' ended: " << e.what());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn->fd = -1;  // the Socket closes it when this function returns
  }
  conn->done.store(true);
}

// ---------------------------------------------------------------------- Dial
Socket Dial(const std::string& host, uint16_t port, Channel channel, const HandshakeOptions& opts,
            const std::string& expectedKey, int64_t connectTimeoutMs, SessionKeys* keys,
            const std::atomic<bool>* stop) {
  const std::string where = host + ":" + std::to_string(port);
  Socket sock = ConnectTcp(host, port, connectTimeoutMs);
  std::string err;
  const int64_t t = opts.timeoutMs;
  Nonce clientNonce = RandomNonce();
  ByteWriter w;
  w.Put<uint32_t>(kHelloMagic);
  w.Put<uint16_t>(kProtocolVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(channel));
  w.PutBytes(clientNonce.data(), clientNonce.size());
  if (!SendMsg(sock, w.bytes(), t, &err)) throw BadState("handshake with " + where + ": " + err);

  std::vector<uint8_t> body;
  if (!RecvMsg(sock, &body, t, &err, stop)) throw BadState("handshake with " + where + ": " + err);
  ByteReader r(body.data(), body.size(), "server hello");
  if (r.Get<uint32_t>() != kHelloMagic) throw BadState("handshake with " + where + ": not a MORI-IO engine");
  uint16_t version = r.Get<uint16_t>();
  if (version != kProtocolVersion)
    throw BadState("handshake with " + where + ": protocol version " + std::to_string(version) + ", expected " +
                   std::to_string(kProtocolVersion) + " (both engines need the same mori-suite version)");
  Nonce serverNonce;
  r.GetBytes(serverNonce.data(), serverNonce.size());

  const std::string transcript = Transcript(channel, clientNonce, serverNonce, opts.selfKey);
  Digest cp = ClientProof(opts.secret, transcript);
  ByteWriter pw;
  pw.PutString(opts.selfKey);
  pw.PutBytes(cp.data(), cp.size());
  if (!SendMsg(sock, pw.bytes(), t, &err)) throw BadState("handshake with " + where + ": " + err);

  if (!RecvMsg(sock, &body, t, &err, stop)) throw BadState("handshake with " + where + ": " + err);
  ByteReader f(body.data(), body.size(), "server verdict");
  if (f.Get<uint8_t>() != kVerdictAccepted)
    throw BadState("engine at " + where +
                   " refused this engine's credentials (set the same MORI_IO_AUTH_SECRET on both sides)");
  std::string serverKey = f.GetString(kMaxKeyBytes);
  Digest serverProof;
  f.GetBytes(serverProof.data(), serverProof.size());
  if (!opts.secret.empty() && !ConstantTimeEqual(serverProof, ServerProof(opts.secret, transcript, serverKey)))
    throw BadState("engine '" + serverKey + "' at " + where +
                   " failed authentication: it did not prove the shared secret (it has none, or another one)");
  if (!expectedKey.empty() && serverKey != expectedKey)
    throw BadState("engine at " + where + " is '" + serverKey + "', expected '" + expectedKey + "'");
  if (keys) *keys = DeriveKeys(opts.secret, transcript, serverKey);
  return sock;
}

}  // namespace mori::io::net
