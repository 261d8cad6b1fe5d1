#include "io/net/control_plane.hpp"

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
#include "io/net/auth.hpp"

namespace mori::io::net {
namespace {

constexpr uint32_t kHelloMagic = 0x4f49524d;  // "MRIO"
constexpr uint16_t kProtocolVersion = 1;
constexpr uint32_t kMaxHandshakeBytes = 4096;
constexpr uint8_t kFlagHasSecret = 1;

// Handshake messages travel as u32 length + body.
bool SendMsg(Socket& s, const std::vector<uint8_t>& body, int64_t timeoutMs, std::string* err) {
  uint32_t n = static_cast<uint32_t>(body.size());
  struct iovec iov[2] = {{&n, sizeof(n)}, {const_cast<uint8_t*>(body.data()), body.size()}};
  return s.SendV(iov, 2, timeoutMs, err);
}

bool RecvMsg(Socket& s, std::vector<uint8_t>* body, int64_t timeoutMs, std::string* err) {
  uint32_t n = 0;
  if (!s.RecvAll(&n, sizeof(n), timeoutMs, err)) return false;
  if (n > kMaxHandshakeBytes) {
    *err = "handshake message of " + std::to_string(n) + " bytes exceeds " + std::to_string(kMaxHandshakeBytes);
    return false;
  }
  body->resize(n);
  return s.RecvAll(body->data(), n, timeoutMs, err);
}

std::string ProofInput(const char* role, const Nonce& nonce, const std::string& key) {
  std::string m(role);
  m.append(reinterpret_cast<const char*>(nonce.data()), nonce.size());
  m.append(key);
  return m;
}

Digest Proof(const std::string& secret, const char* role, const Nonce& nonce, const std::string& key) {
  if (secret.empty()) return Digest{};
  return HmacSha256(secret, ProofInput(role, nonce, key));
}

}  // namespace

// ------------------------------------------------------------------ Listener
Listener::Listener(const std::string& host, uint16_t port, HandshakeOptions opts) : opts_(std::move(opts)) {
  if (!opts_.secret.empty()) (void)HmacSha256(opts_.secret, "probe");  // fail now if libcrypto is missing
  listenFd_ = ListenTcp(host, port, &port_);
  acceptThread_ = std::thread([this] { AcceptLoop(); });
}

Listener::~Listener() { Stop(); }

void Listener::SetHandler(Channel channel, ChannelHandler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  handlers_[channel] = std::move(handler);
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
    int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (conns_.size() >= kMaxConnections) {
      MORI_WARN("control plane: refusing connection, " << kMaxConnections << " connections already open");
      ::close(fd);
      continue;
    }
    auto conn = std::make_unique<Conn>();
    Conn* raw = conn.get();
    raw->fd = fd;
    conns_.push_back(std::move(conn));
    raw->thread = std::thread([this, raw, fd] { Serve(raw, Socket(fd)); });
  }
}

void Listener::Serve(Conn* conn, Socket sock) {
  std::string err;
  const int64_t t = opts_.timeoutMs;
  PeerHello peer{};
  try {
    // 1. ClientHello: magic, version, channel, flags, key, nonce.
    std::vector<uint8_t> body;
    if (!RecvMsg(sock, &body, t, &err)) throw BadState("client hello: " + err);
    ByteReader r(body.data(), body.size(), "client hello");
    if (r.Get<uint32_t>() != kHelloMagic) throw BadState("client hello: bad magic (not a MORI-IO peer)");
    uint16_t version = r.Get<uint16_t>();
    if (version != kProtocolVersion)
      throw BadState("client hello: protocol version " + std::to_string(version) + ", expected " +
                     std::to_string(kProtocolVersion));
    uint8_t channel = r.Get<uint8_t>();
    (void)r.Get<uint8_t>();  // client flags
    peer.engineKey = r.GetString(kMaxKeyBytes);
    Nonce clientNonce;
    r.GetBytes(clientNonce.data(), clientNonce.size());
    if (channel < 1 || channel > 3) throw BadState("client hello: unknown channel " + std::to_string(channel));
    peer.channel = static_cast<Channel>(channel);

    // 2. ServerHello: our key, our nonce, our proof over the client's nonce.
    Nonce serverNonce = RandomNonce();
    ByteWriter w;
    w.Put<uint32_t>(kHelloMagic);
    w.Put<uint16_t>(kProtocolVersion);
    w.Put<uint8_t>(opts_.secret.empty() ? 0 : kFlagHasSecret);
    w.PutString(opts_.selfKey);
    w.PutBytes(serverNonce.data(), serverNonce.size());
    Digest sp = Proof(opts_.secret, "server", clientNonce, opts_.selfKey);
    w.PutBytes(sp.data(), sp.size());
    if (!SendMsg(sock, w.bytes(), t, &err)) throw BadState("server hello: " + err);

    // 3. ClientProof, 4. verdict.
    if (!RecvMsg(sock, &body, t, &err)) throw BadState("client proof: " + err);
    ByteReader pr(body.data(), body.size(), "client proof");
    Digest cp;
    pr.GetBytes(cp.data(), cp.size());
    bool ok = opts_.secret.empty() || ConstantTimeEqual(cp, Proof(opts_.secret, "client", serverNonce, peer.engineKey));
    ByteWriter v;
    v.Put<uint8_t>(ok ? 1 : 0);
    (void)SendMsg(sock, v.bytes(), t, &err);
    if (!ok) throw BadState("peer '" + peer.engineKey + "' failed authentication (wrong or missing secret)");
  } catch (const std::exception& e) {
    MORI_WARN("control plane: dropped connection during handshake: " << e.what());
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
    MORI_WARN("control plane: no backend serves channel " << static_cast<int>(peer.channel)
                                                          << " requested by '" << peer.engineKey << "'");
  } else {
    try {
      handler(sock, peer, stopping_);
    } catch (const std::exception& e) {
      MORI_WARN("control plane: connection from '" << peer.engineKey << "' ended: " << e.what());
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
            const std::string& expectedKey, int64_t connectTimeoutMs) {
  const std::string where = host + ":" + std::to_string(port);
  Socket sock = ConnectTcp(host, port, connectTimeoutMs);
  std::string err;
  const int64_t t = opts.timeoutMs;
  Nonce clientNonce = RandomNonce();
  ByteWriter w;
  w.Put<uint32_t>(kHelloMagic);
  w.Put<uint16_t>(kProtocolVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(channel));
  w.Put<uint8_t>(opts.secret.empty() ? 0 : kFlagHasSecret);
  w.PutString(opts.selfKey);
  w.PutBytes(clientNonce.data(), clientNonce.size());
  if (!SendMsg(sock, w.bytes(), t, &err)) throw BadState("handshake with " + where + ": " + err);

  std::vector<uint8_t> body;
  if (!RecvMsg(sock, &body, t, &err)) throw BadState("handshake with " + where + ": " + err);
  ByteReader r(body.data(), body.size(), "server hello");
  if (r.Get<uint32_t>() != kHelloMagic) throw BadState("handshake with " + where + ": not a MORI-IO engine");
  uint16_t version = r.Get<uint16_t>();
  if (version != kProtocolVersion)
    throw BadState("handshake with " + where + ": protocol version " + std::to_string(version));
  uint8_t flags = r.Get<uint8_t>();
  std::string serverKey = r.GetString(kMaxKeyBytes);
  Nonce serverNonce;
  r.GetBytes(serverNonce.data(), serverNonce.size());
  Digest serverProof;
  r.GetBytes(serverProof.data(), serverProof.size());

  if (!expectedKey.empty() && serverKey != expectedKey)
    throw BadState("engine at " + where + " is '" + serverKey + "', expected '" + expectedKey + "'");
  if (!opts.secret.empty()) {
    if (!(flags & kFlagHasSecret))
      throw BadState("engine '" + serverKey + "' at " + where +
                     " does not use an auth secret but this engine requires one");
    if (!ConstantTimeEqual(serverProof, Proof(opts.secret, "server", clientNonce, serverKey)))
      throw BadState("engine '" + serverKey + "' at " + where + " failed authentication (different secret)");
  }
  Digest cp = Proof(opts.secret, "client", serverNonce, opts.selfKey);
  ByteWriter pw;
  pw.PutBytes(cp.data(), cp.size());
  if (!SendMsg(sock, pw.bytes(), t, &err)) throw BadState("handshake with " + where + ": " + err);
  if (!RecvMsg(sock, &body, t, &err) || body.size() != 1)
    throw BadState("handshake with " + where + ": " + (err.empty() ? "bad verdict" : err));
  if (body[0] != 1)
    throw BadState("engine '" + serverKey + "' at " + where +
                   " refused this engine's credentials (set the same MORI_IO_AUTH_SECRET on both sides)");
  return sock;
}

}  // namespace mori::io::net
