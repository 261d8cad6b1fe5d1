// Target-side notifications for backends whose data path does not pass
// through the target (intra-node GPU copies): after the data landed, the
// initiator tells the target "transfer (my key, uid) is complete" over the
// target's control plane (channel Notify), or directly when both engines live
// in this process. The target records it in its NotificationTable, so
// pop_inbound_transfer_status works the same for every backend.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "io/common.hpp"
#include "io/engine_context.hpp"
#include "io/net/control_plane.hpp"

namespace mori::io {

// Process-wide directory of live engines, for same-process delivery.
class LocalEngineDirectory {
 public:
  static LocalEngineDirectory& Get();
  void Add(const std::string& key, EngineContext* ctx);
  void Remove(const std::string& key, EngineContext* ctx);
  // Records (fromKey, uid) at engine `toKey` if it lives here; false otherwise.
  bool Deliver(const std::string& toKey, const std::string& fromKey, TransferUniqueId uid);

 private:
  std::mutex mu_;
  std::unordered_map<std::string, EngineContext*> engines_;
};

// The session of one inbound Notify connection (registered by the engine on its listener).
std::unique_ptr<net::ChannelSession> NewNotifySession(EngineContext& ctx, net::Socket& sock,
                                                      const net::PeerHello& peer);

// Sends notifications from one engine, one background thread, one persistent
// connection per remote engine. Notify() never blocks the caller.
class NotificationSender {
 public:
  explicit NotificationSender(EngineContext& ctx);
  ~NotificationSender();
  void Notify(const EngineDesc& target, TransferUniqueId uid);
  void Forget(const std::string& remoteKey);

 private:
  struct Item {
    EngineDesc target;
    TransferUniqueId uid;
  };
  void Loop();
  EngineContext& ctx_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  struct Conn {
    net::Socket sock;
    net::FrameMac mac;
    uint64_t sent = 0;  // frames sent: the counter both sides put under the tags
  };
  std::unordered_map<std::string, Conn> conns_;  // only touched by the thread
  std::unordered_map<std::string, bool> forget_;
  std::unordered_map<std::string, bool> warnedNoListener_;  // only touched by the thread
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mori::io
