// Liveness of one remote engine while transfers to it are outstanding.
//
// TCP keepalive cannot see a stopped process (SIGSTOP, a hung host process):
// its kernel still acknowledges. The data connections cannot ask either: the
// target's thread of a connection is busy with a frame. So a PeerLink with
// work outstanding pings the peer's listener over its own small connection
// (Channel::Heartbeat, authenticated like the rest) every interval; a peer
// that leaves a ping unanswered for `timeoutMs` is declared stopped and the
// link's connections are failed. A live peer answers from another thread in
// microseconds, however slowly its transfers move.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "io/net/control_plane.hpp"

namespace mori::io::tcp {

struct LinkTarget;

class Heartbeat {
 public:
  // `busy` says whether transfers are outstanding; `onStopped` fails them.
  Heartbeat(const LinkTarget& target, std::function<bool()> busy, std::function<void(const std::string&)> onStopped);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // Work was submitted: start pinging now.
  void Kick();

 private:
  void Loop();
  // One ping/pong; false with *why when the peer did not answer in time.
  bool Probe(std::string* why);

  const LinkTarget& target_;
  const int64_t timeoutMs_;
  std::function<bool()> busy_;
  std::function<void(const std::string&)> onStopped_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool kicked_ = false;
  std::atomic<bool> stop_{false};
  net::Socket sock_;
  net::FrameMac tx_, rx_;
  uint64_t count_ = 0;
  std::thread thread_;
};

}  // namespace mori::io::tcp
