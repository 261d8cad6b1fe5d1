// The engine's control-plane listener: one TCP port per engine, shared by
// every backend that talks over the network.
//
// One event-loop thread (epoll) accepts connections and runs the server side
// of every handshake without blocking. Unauthenticated connections are capped
// (ListenerLimits.maxHandshakes; over it the oldest is closed first) and each
// has one deadline for the whole handshake (HandshakeOptions.timeoutMs), so a
// flood of silent or half-open connections costs neither threads nor more
// than a bounded amount of memory. An authenticated connection is handed to
// its channel's session; it is served on a thread of a bounded pool only
// while a request is there, and waits in the event loop otherwise (closed
// after the idle timeout).
#pragma once

#include <sys/epoll.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "io/net/channel.hpp"
#include "io/net/handshake.hpp"
#include "io/net/serve_pool.hpp"

namespace mori::io::net {

class Listener {
 public:
  Listener(const std::string& host, uint16_t port, HandshakeOptions opts, ListenerLimits limits = {});
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  uint16_t port() const { return port_; }
  // Sessions already made keep running after their handler is replaced or removed.
  void SetHandler(Channel channel, ChannelHandler handler);
  void Stop();

 private:
  using Clock = std::chrono::steady_clock;
  enum class State : uint8_t { Dispatched, Parked };
  struct Conn {
    uint64_t id = 0;
    Socket sock;
    std::string address;
    // Handshake (only the event loop touches these).
    bool handshaking = true;
    std::unique_ptr<ServerHandshake> hs;
    Clock::time_point deadline;
    std::list<std::unique_ptr<Conn>>::iterator pendingPos;
    // Served (guarded by mu_). The session goes before the socket closes.
    State state = State::Dispatched;
    bool closing = false;
    std::string closeReason;
    Clock::time_point parkedAt;
    PeerHello peer;
    std::unique_ptr<ChannelSession> session;
    ~Conn() { session.reset(); }
  };

  void Loop();
  void AcceptReady(Clock::time_point now);
  void OnHandshakeEvent(Conn* c);
  void DropHandshake(Conn* c);
  void Promote(Conn* c);
  void ExpireHandshakes(Clock::time_point now);
  void Sweep(Clock::time_point now);
  void Dispatch(Conn* c);
  // On a pool thread.
  void Serve(Conn* c);
  void Park(Conn* c);
  void Close(Conn* c);
  int Arm(int op, int fd, uint64_t id, uint32_t events);

  HandshakeOptions opts_;
  ListenerLimits limits_;
  int listenFd_ = -1;
  int epollFd_ = -1;
  int wakeFd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stopped_{false};

  // Event loop only.
  uint64_t nextId_ = 2;  // 0: the listening socket, 1: the wake-up eventfd
  std::list<std::unique_ptr<Conn>> pending_;  // in accept order = deadline order
  std::unordered_map<uint64_t, Conn*> pendingById_;
  Clock::time_point acceptPausedUntil_{};
  bool acceptPaused_ = false;

  std::mutex mu_;
  std::map<Channel, ChannelHandler> handlers_;
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> served_;

  ServePool pool_;
  ServePool urgentPool_;  // sessions that answer liveness probes
  std::thread loop_;
};

}  // namespace mori::io::net
