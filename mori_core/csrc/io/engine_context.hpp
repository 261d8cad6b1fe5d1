// What the engine shares with its backends: identity, registered memory, the
// inbound notification table, known remote engines and the control plane.
#pragma once

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "io/common.hpp"
#include "io/memory_table.hpp"
#include "io/net/control_plane.hpp"
#include "io/notification_table.hpp"

namespace mori::io {

class RemoteEngineTable {
 public:
  void Put(const EngineDesc& d);
  void Erase(const std::string& key);
  // nullptr-like: returns false when unknown.
  bool Get(const std::string& key, EngineDesc* out) const;

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<std::string, EngineDesc> engines_;
};

// The listener's caps from MORI_IO_MAX_HANDSHAKES, MORI_IO_MAX_CONNECTIONS and
// MORI_IO_SERVE_THREADS (out-of-range values raise, naming the variable).
net::ListenerLimits ListenerLimitsFromEnv();

struct EngineContext {
  std::string key;
  IOEngineConfig config;
  MemoryTable memory;
  NotificationTable notifications;
  RemoteEngineTable remotes;

  // Guards `desc` and `listener`.
  mutable std::mutex mu;
  EngineDesc desc;
  std::unique_ptr<net::Listener> listener;

  // Starts the control-plane listener on first use and publishes its port in
  // `desc`. Thread-safe; returns the listener.
  net::Listener& EnsureListener();
  net::HandshakeOptions Handshake() const;
  EngineDesc Desc() const {
    std::lock_guard<std::mutex> lock(mu);
    return desc;
  }
};

}  // namespace mori::io
