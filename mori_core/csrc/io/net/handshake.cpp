#include "io/net/handshake.hpp"

#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/byte_codec.hpp"
#include "common/error.hpp"
#include "io/common.hpp"

namespace mori::io::net {
namespace {

constexpr uint32_t kHelloMagic = 0x4f49524d;  // "MRIO"
// 2: the server proves itself only after the client did; keys and proofs are
// bound to the whole transcript; per-connection frame keys.
constexpr uint16_t kProtocolVersion = 2;
constexpr uint8_t kVerdictAccepted = 1;

using Clock = std::chrono::steady_clock;

int64_t MsLeft(Clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
}

std::vector<uint8_t> Framed(const std::vector<uint8_t>& body) {
  ByteWriter w;
  w.Put<uint32_t>(static_cast<uint32_t>(body.size()));
  w.PutBytes(body.data(), body.size());
  return w.Take();
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

// Client side: every wait takes what is left of the one deadline, so a server
// that trickles its bytes cannot stretch the handshake either.
bool RecvBy(Socket& s, void* data, size_t n, Clock::time_point deadline, std::string* err,
            const std::atomic<bool>* stop) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    int64_t left = MsLeft(deadline);
    if (left <= 0) {
      *err = "timed out: the handshake did not finish within its deadline";
      return false;
    }
    ssize_t r = s.RecvSome(p, n, left, err, stop);
    if (r < 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool RecvMsgBy(Socket& s, std::vector<uint8_t>* body, Clock::time_point deadline, std::string* err,
               const std::atomic<bool>* stop) {
  uint32_t n = 0;
  if (!RecvBy(s, &n, sizeof(n), deadline, err, stop)) return false;
  if (n > kMaxHandshakeMsgBytes) {
    *err = "handshake message of " + std::to_string(n) + " bytes exceeds " + std::to_string(kMaxHandshakeMsgBytes);
    return false;
  }
  body->resize(n);
  return RecvBy(s, body->data(), n, deadline, err, stop);
}

bool SendBy(Socket& s, const std::vector<uint8_t>& body, Clock::time_point deadline, std::string* err) {
  int64_t left = MsLeft(deadline);
  if (left <= 0) {
    *err = "timed out: the handshake did not finish within its deadline";
    return false;
  }
  return s.SendAll(Framed(body).data(), body.size() + 4, left, err);
}

// Server side: one answer of at most a few hundred bytes on a fresh socket
// always fits the send buffer; a peer that let it fill is not a MORI engine.
bool SendNow(Socket& s, const std::vector<uint8_t>& body, std::string* err) {
  std::vector<uint8_t> msg = Framed(body);
  ssize_t w;
  do {
    w = ::send(s.fd(), msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (w < 0 && errno == EINTR);
  if (w == static_cast<ssize_t>(msg.size())) return true;
  *err = w < 0 ? std::string("send: ") + std::strerror(errno) : "the peer does not read its answers";
  return false;
}

}  // namespace

// ------------------------------------------------------------- client side
Socket Dial(const std::string& host, uint16_t port, Channel channel, const HandshakeOptions& opts,
            const std::string& expectedKey, int64_t connectTimeoutMs, SessionKeys* keys,
            const std::atomic<bool>* stop) {
  const std::string where = host + ":" + std::to_string(port);
  Socket sock = ConnectTcp(host, port, connectTimeoutMs);
  const auto deadline = Clock::now() + std::chrono::milliseconds(opts.timeoutMs);
  std::string err;
  Nonce clientNonce = RandomNonce();
  ByteWriter w;
  w.Put<uint32_t>(kHelloMagic);
  w.Put<uint16_t>(kProtocolVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(channel));
  w.PutBytes(clientNonce.data(), clientNonce.size());
  if (!SendBy(sock, w.bytes(), deadline, &err)) throw BadState("handshake with " + where + ": " + err);

  std::vector<uint8_t> body;
  if (!RecvMsgBy(sock, &body, deadline, &err, stop)) throw BadState("handshake with " + where + ": " + err);
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
  if (!SendBy(sock, pw.bytes(), deadline, &err)) throw BadState("handshake with " + where + ": " + err);

  if (!RecvMsgBy(sock, &body, deadline, &err, stop)) throw BadState("handshake with " + where + ": " + err);
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

// ------------------------------------------------------------- server side
ServerHandshake::ServerHandshake(const HandshakeOptions& opts, std::string address) : opts_(opts) {
  peer_.address = std::move(address);
  peer_.idleTimeoutMs = opts.idleTimeoutMs;
}

const char* ServerHandshake::waitingFor() const {
  switch (phase_) {
    case Phase::Hello: return "client hello";
    case Phase::Proof: return "client proof";
    default: return "nothing";
  }
}

bool ServerHandshake::Fail(const std::string& why) {
  error_ = std::string(waitingFor()) + ": " + why;
  return false;
}

bool ServerHandshake::ReadMessage(Socket& sock, bool* complete) {
  *complete = false;
  while (true) {
    // Only the bytes of the current message are taken: whatever follows
    // stays in the socket for the channel.
    uint8_t* dst;
    size_t want;
    if (lenBytes_ < sizeof(lenBuf_)) {
      dst = lenBuf_ + lenBytes_;
      want = sizeof(lenBuf_) - lenBytes_;
    } else {
      dst = body_.data() + got_;
      want = body_.size() - got_;
      if (want == 0) {
        *complete = true;
        return true;
      }
    }
    ssize_t r = ::recv(sock.fd(), dst, want, MSG_DONTWAIT);
    if (r == 0) return Fail("connection closed by peer");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      return Fail(std::string("recv: ") + std::strerror(errno));
    }
    if (lenBytes_ < sizeof(lenBuf_)) {
      lenBytes_ += static_cast<uint8_t>(r);
      if (lenBytes_ == sizeof(lenBuf_)) {
        uint32_t n;
        std::memcpy(&n, lenBuf_, sizeof(n));
        if (n > kMaxHandshakeMsgBytes)
          return Fail("message of " + std::to_string(n) + " bytes exceeds " + std::to_string(kMaxHandshakeMsgBytes));
        body_.assign(n, 0);
        got_ = 0;
      }
    } else {
      got_ += static_cast<uint32_t>(r);
    }
  }
}

ServerHandshake::Result ServerHandshake::Advance(Socket& sock) {
  try {
    while (phase_ != Phase::Done) {
      bool complete = false;
      if (!ReadMessage(sock, &complete)) return Result::Failed;
      if (!complete) return Result::Pending;
      bool ok = phase_ == Phase::Hello ? OnClientHello(sock) : OnClientProof(sock);
      if (!ok) return Result::Failed;
      lenBytes_ = 0;
      body_.clear();
      body_.shrink_to_fit();
    }
    return Result::Accepted;
  } catch (const std::exception& e) {  // a truncated message (ByteReader) or libcrypto
    Fail(e.what());
    return Result::Failed;
  }
}

bool ServerHandshake::OnClientHello(Socket& sock) {
  ByteReader r(body_.data(), body_.size(), "client hello");
  if (r.Get<uint32_t>() != kHelloMagic) return Fail("bad magic (not a MORI-IO peer)");
  uint16_t version = r.Get<uint16_t>();
  if (version != kProtocolVersion)
    return Fail("protocol version " + std::to_string(version) + ", expected " + std::to_string(kProtocolVersion));
  uint8_t channel = r.Get<uint8_t>();
  r.GetBytes(clientNonce_.data(), clientNonce_.size());
  if (!ValidChannel(channel)) return Fail("unknown channel " + std::to_string(channel));
  peer_.channel = static_cast<Channel>(channel);

  // ServerHello: only a fresh nonce (nothing about this engine yet).
  serverNonce_ = RandomNonce();
  ByteWriter w;
  w.Put<uint32_t>(kHelloMagic);
  w.Put<uint16_t>(kProtocolVersion);
  w.PutBytes(serverNonce_.data(), serverNonce_.size());
  std::string err;
  if (!SendNow(sock, w.bytes(), &err)) return Fail("server hello: " + err);
  phase_ = Phase::Proof;
  return true;
}

bool ServerHandshake::OnClientProof(Socket& sock) {
  ByteReader pr(body_.data(), body_.size(), "client proof");
  peer_.engineKey = pr.GetString(kMaxKeyBytes);
  Digest cp;
  pr.GetBytes(cp.data(), cp.size());
  const std::string transcript = Transcript(peer_.channel, clientNonce_, serverNonce_, peer_.engineKey);
  const bool ok = opts_.secret.empty() || ConstantTimeEqual(cp, ClientProof(opts_.secret, transcript));
  // ServerFinal: the key and proof only for a client that proved the secret.
  ByteWriter v;
  v.Put<uint8_t>(ok ? kVerdictAccepted : 0);
  if (ok) {
    v.PutString(opts_.selfKey);
    Digest sp = ServerProof(opts_.secret, transcript, opts_.selfKey);
    v.PutBytes(sp.data(), sp.size());
  }
  std::string err;
  const bool sent = SendNow(sock, v.bytes(), &err);
  if (!ok) return Fail("peer '" + peer_.engineKey + "' failed authentication (wrong or missing secret)");
  if (!sent) return Fail("server final: " + err);
  peer_.keys = DeriveKeys(opts_.secret, transcript, opts_.selfKey);
  phase_ = Phase::Done;
  return true;
}

}  // namespace mori::io::net
