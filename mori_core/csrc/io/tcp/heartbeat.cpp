#include "io/tcp/heartbeat.hpp"

#include <chrono>

#include "common/logging.hpp"
#include "io/tcp/peer_link.hpp"

namespace mori::io::tcp {
namespace {

constexpr int64_t kIntervalMs = 200;  // between pings while busy
constexpr uint32_t kPingBytes = 8;

}  // namespace

Heartbeat::Heartbeat(const LinkTarget& target, std::function<bool()> busy,
                     std::function<void(const std::string&)> onStopped)
    : target_(target),
      timeoutMs_(target.config.heartbeatTimeoutMs),
      busy_(std::move(busy)),
      onStopped_(std::move(onStopped)) {
  if (timeoutMs_ > 0) thread_ = std::thread([this] { Loop(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Heartbeat::Kick() {
  if (timeoutMs_ <= 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    kicked_ = true;
  }
  cv_.notify_one();
}

bool Heartbeat::Probe(std::string* why) {
  const auto start = std::chrono::steady_clock::now();
  auto left = [&] {
    return timeoutMs_ - std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start)
                            .count();
  };
  std::string err;
  if (!sock_.valid()) {
    net::HandshakeOptions hs = target_.handshake;
    hs.timeoutMs = timeoutMs_;  // a stopped peer does not finish a handshake either
    net::SessionKeys keys;
    try {
      sock_ = net::Dial(target_.remote.host, target_.remote.port, net::Channel::Heartbeat, hs, target_.remote.key,
                        std::min(timeoutMs_, target_.config.connectTimeoutMs), &keys, &stop_);
    } catch (const std::exception& e) {
      // Refused or reset: the data connections see that themselves. Only
      // silence means "stopped".
      std::string m = e.what();
      if (m.find("timed out") != std::string::npos) {
        *why = "no answer to a heartbeat handshake within " + std::to_string(timeoutMs_) + " ms";
        return false;
      }
      return true;
    }
    tx_ = keys.ForSending(true);
    rx_ = keys.ForReceiving(true);
    count_ = 0;
  }
  uint64_t ping = count_;
  std::vector<uint8_t> pong;
  bool ok = net::SendAuthedMsg(sock_, tx_, count_, &ping, kPingBytes, std::max<int64_t>(left(), 1), &err) &&
            net::RecvAuthedMsg(sock_, rx_, count_, &pong, kPingBytes, std::max<int64_t>(left(), 1), &err, &stop_);
  ++count_;
  if (ok) return true;
  sock_.Close();
  if (err.rfind("timed out", 0) == 0) {
    *why = "peer stopped answering heartbeats (none for " + std::to_string(timeoutMs_) + " ms)";
    return false;
  }
  return true;  // closed/reset/refused: the data connections fail by themselves
}

void Heartbeat::Loop() {
  while (!stop_.load()) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(kIntervalMs), [&] { return stop_.load() || kicked_; });
      kicked_ = false;
    }
    if (stop_.load() || !busy_()) continue;
    std::string why;
    if (!Probe(&why) && !stop_.load() && busy_()) {
      MORI_WARN("engine '" << target_.remote.key << "' (" << target_.remote.host << ":" << target_.remote.port
                           << "): " << why << "; failing its transfers");
      onStopped_(why);
    }
  }
}

}  // namespace mori::io::tcp
