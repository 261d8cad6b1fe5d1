#include "io/notify_channel.hpp"

#include "common/logging.hpp"

namespace mori::io {
namespace {

constexpr uint32_t kNotifyMagic = 0x4e54464d;  // "MFTN"

#pragma pack(push, 1)
struct NotifyFrame {
  uint32_t magic;
  uint32_t parts;  // always 1 today; kept for symmetry with the table
  uint64_t uid;
};
#pragma pack(pop)

}  // namespace

LocalEngineDirectory& LocalEngineDirectory::Get() {
  static LocalEngineDirectory d;
  return d;
}

void LocalEngineDirectory::Add(const std::string& key, EngineContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  engines_[key] = ctx;
}

void LocalEngineDirectory::Remove(const std::string& key, EngineContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = engines_.find(key);
  if (it != engines_.end() && it->second == ctx) engines_.erase(it);
}

bool LocalEngineDirectory::Deliver(const std::string& toKey, const std::string& fromKey, TransferUniqueId uid) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = engines_.find(toKey);
  if (it == engines_.end()) return false;
  it->second->notifications.Record(fromKey, uid, 1);
  return true;
}

void ServeNotifyChannel(EngineContext& ctx, net::Socket& sock, const net::PeerHello& peer,
                        const std::atomic<bool>& stopping) {
  std::string err;
  while (!stopping.load()) {
    NotifyFrame f{};
    if (!sock.RecvAll(&f, 1, -1, &err, &stopping)) break;
    if (!sock.RecvAll(reinterpret_cast<uint8_t*>(&f) + 1, sizeof(f) - 1, 5000, &err)) break;
    if (f.magic != kNotifyMagic || f.parts != 1) {
      MORI_WARN("notify channel from '" << peer.engineKey << "': malformed frame, dropping connection");
      return;
    }
    ctx.notifications.Record(peer.engineKey, f.uid, 1);
  }
}

NotificationSender::NotificationSender(EngineContext& ctx) : ctx_(ctx), thread_([this] { Loop(); }) {}

NotificationSender::~NotificationSender() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void NotificationSender::Notify(const EngineDesc& target, TransferUniqueId uid) {
  if (target.pid == static_cast<int32_t>(ctx_.desc.pid) && target.nodeId == ctx_.desc.nodeId &&
      LocalEngineDirectory::Get().Deliver(target.key, ctx_.key, uid))
    return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({target, uid});
  }
  cv_.notify_one();
}

void NotificationSender::Forget(const std::string& remoteKey) {
  std::lock_guard<std::mutex> lock(mu_);
  forget_[remoteKey] = true;
  cv_.notify_one();
}

void NotificationSender::Loop() {
  while (true) {
    Item item;
    std::unordered_map<std::string, bool> forget;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty() || !forget_.empty(); });
      if (stop_) return;
      forget.swap(forget_);
      if (queue_.empty()) {
        lock.unlock();
        for (auto& [k, v] : forget) conns_.erase(k);
        continue;
      }
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    for (auto& [k, v] : forget) conns_.erase(k);
    const EngineDesc& t = item.target;
    if (t.port == 0 || t.host.empty()) {
      if (!warnedNoListener_[t.key])  // once per target: it will not change
        MORI_WARN("cannot notify engine '" << t.key << "' of transfers (first: " << item.uid
                                           << "): it has no listener (create a TCP or RDMA backend there, or use "
                                              "the same process)");
      warnedNoListener_[t.key] = true;
      continue;
    }
    NotifyFrame f{kNotifyMagic, 1, item.uid};
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto it = conns_.find(t.key);
      try {
        if (it == conns_.end())
          it = conns_.emplace(t.key, net::Dial(t.host, t.port, net::Channel::Notify, ctx_.Handshake(), t.key, 2000))
                   .first;
      } catch (const std::exception& e) {
        MORI_WARN("cannot notify engine '" << t.key << "' of transfer " << item.uid << ": " << e.what());
        break;
      }
      std::string err;
      if (it->second.SendAll(&f, sizeof(f), 2000, &err)) break;
      conns_.erase(it);  // stale connection (peer restarted): redial once
      if (attempt == 1) MORI_WARN("cannot notify engine '" << t.key << "' of transfer " << item.uid << ": " << err);
    }
  }
}

}  // namespace mori::io
