#include "io/engine_context.hpp"

#include "common/env.hpp"
#include "common/error.hpp"
#include "io/notify_channel.hpp"

namespace mori::io {

void RemoteEngineTable::Put(const EngineDesc& d) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  engines_[d.key] = d;
}

void RemoteEngineTable::Erase(const std::string& key) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  engines_.erase(key);
}

bool RemoteEngineTable::Get(const std::string& key, EngineDesc* out) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = engines_.find(key);
  if (it == engines_.end()) return false;
  *out = it->second;
  return true;
}

net::HandshakeOptions EngineContext::Handshake() const {
  net::HandshakeOptions o;
  o.selfKey = key;
  o.secret = config.authSecret;
  o.timeoutMs = env::GetInt("MORI_IO_CP_TIMEOUT_MS", 5000);
  o.idleTimeoutMs = env::GetInt("MORI_IO_IDLE_TIMEOUT_MS", 300000);
  return o;
}

namespace {
size_t LimitFromEnv(const char* name, size_t fallback, int64_t lo, int64_t hi) {
  int64_t v = env::GetInt(name, static_cast<int64_t>(fallback));
  if (v < lo || v > hi)
    throw InvalidArgument(std::string(name) + "=" + std::to_string(v) + " must be in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]");
  return static_cast<size_t>(v);
}
}  // namespace

net::ListenerLimits ListenerLimitsFromEnv() {
  net::ListenerLimits l;
  l.maxHandshakes = LimitFromEnv("MORI_IO_MAX_HANDSHAKES", l.maxHandshakes, 1, 1 << 20);
  l.maxConnections = LimitFromEnv("MORI_IO_MAX_CONNECTIONS", l.maxConnections, 1, 1 << 20);
  l.serveThreads = LimitFromEnv("MORI_IO_SERVE_THREADS", l.serveThreads, 1, 4096);
  return l;
}

net::Listener& EngineContext::EnsureListener() {
  std::lock_guard<std::mutex> lock(mu);
  if (!listener) {
    listener = std::make_unique<net::Listener>(config.host, config.port, Handshake(), ListenerLimitsFromEnv());
    EngineContext* self = this;
    listener->SetHandler(net::Channel::Notify, [self](net::Socket& s, const net::PeerHello& p) {
      return NewNotifySession(*self, s, p);
    });
    desc.port = listener->port();
    config.port = listener->port();
  }
  return *listener;
}

}  // namespace mori::io
