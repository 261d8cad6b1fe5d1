#include "io/notify_channel.hpp"

#include <poll.h>

#include <cstring>

#include "common/logging.hpp"
#include "io/net/log_limiter.hpp"

namespace mori::io {
namespace {

constexpr uint32_t kNotifyMagic = 0x4e54464d;  // "MFTN"

#pragma pack(push, 1)
struct NotifyFrame {
  uint32_t magic;
  uint32_t parts;  // always 1 today; kept for symmetry with the table
  uint64_t uid;
  uint8_t tag[16];  // over the fields above and the frame's position on the stream (zero without a secret)
};
#pragma pack(pop)
constexpr size_t kNotifySigned = sizeof(NotifyFrame) - 16;

// The target never sends on this channel: anything readable is its FIN or RST.
bool PeerClosed(const net::Socket& s) {
  struct pollfd p{s.fd(), POLLIN | POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0;
}

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

namespace {

// Records each authenticated frame; a malformed or unauthenticated one ends the connection.
class NotifySession : public net::ChannelSession {
 public:
  NotifySession(EngineContext& ctx, const net::PeerHello& peer)
      : ctx_(ctx), key_(peer.engineKey), address_(peer.address), rx_(peer.keys.ForReceiving(false)) {}

  bool OnReadable(net::Socket& sock, const std::atomic<bool>& stopping) override {
    NotifyFrame f{};
    std::string err;
    // A frame's bytes arrive together; 5 s bounds a peer that sends part of one.
    if (!sock.RecvAll(&f, sizeof(f), 5000, &err, &stopping)) return false;
    net::Tag tag;
    std::memcpy(tag.data(), f.tag, tag.size());
    if (f.magic != kNotifyMagic || f.parts != 1 || !rx_.Verify(n_, {{&f, kNotifySigned}}, tag)) {
      MORI_WARN_REMOTE(address_, "notify channel from '" << key_ << "' (" << address_
                                                         << "): malformed or unauthenticated frame, "
                                                            "dropping connection");
      return false;
    }
    ++n_;
    ctx_.notifications.Record(key_, f.uid, 1);
    return true;
  }

 private:
  EngineContext& ctx_;
  std::string key_, address_;
  net::FrameMac rx_;
  uint64_t n_ = 0;  // frames received: the tags' counter
};

}  // namespace

std::unique_ptr<net::ChannelSession> NewNotifySession(EngineContext& ctx, net::Socket&, const net::PeerHello& peer) {
  return std::make_unique<NotifySession>(ctx, peer);
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
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto it = conns_.find(t.key);
      if (it != conns_.end() && PeerClosed(it->second.sock)) {  // e.g. the target's idle timeout
        conns_.erase(it);
        it = conns_.end();
      }
      try {
        if (it == conns_.end()) {
          net::SessionKeys keys;
          net::Socket s = net::Dial(t.host, t.port, net::Channel::Notify, ctx_.Handshake(), t.key, 2000, &keys);
          it = conns_.emplace(t.key, Conn{std::move(s), keys.ForSending(true), 0}).first;
        }
      } catch (const std::exception& e) {
        MORI_WARN("cannot notify engine '" << t.key << "' of transfer " << item.uid << ": " << e.what());
        break;
      }
      Conn& c = it->second;
      NotifyFrame f{kNotifyMagic, 1, item.uid, {}};
      net::Tag tag = c.mac.Sign(c.sent, {{&f, kNotifySigned}});
      std::memcpy(f.tag, tag.data(), tag.size());
      std::string err;
      if (c.sock.SendAll(&f, sizeof(f), 2000, &err)) {
        ++c.sent;
        break;
      }
      conns_.erase(it);  // stale connection (peer restarted): redial once
      if (attempt == 1) MORI_WARN("cannot notify engine '" << t.key << "' of transfer " << item.uid << ": " << err);
    }
  }
}

}  // namespace mori::io
