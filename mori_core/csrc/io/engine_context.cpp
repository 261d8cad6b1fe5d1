#include "io/engine_context.hpp"

#include "common/env.hpp"
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

net::Listener& EngineContext::EnsureListener() {
  std::lock_guard<std::mutex> lock(mu);
  if (!listener) {
    listener = std::make_unique<net::Listener>(config.host, config.port, Handshake());
    EngineContext* self = this;
    listener->SetHandler(net::Channel::Notify,
                         [self](net::Socket& s, const net::PeerHello& p, const std::atomic<bool>& stop) {
                           ServeNotifyChannel(*self, s, p, stop);
                         });
    desc.port = listener->port();
    config.port = listener->port();
  }
  return *listener;
}

}  // namespace mori::io
