#include "io/net/listener.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "common/error.hpp"
#include "common/logging.hpp"
#include "io/net/control_plane.hpp"
#include "io/net/log_limiter.hpp"

namespace mori::io::net {
namespace {

constexpr uint64_t kListenId = 0;
constexpr uint64_t kWakeId = 1;
constexpr int kEventBatch = 128;
// Connections accepted per wake-up: the rest of the loop's work is not starved
// by a flood, and the kernel's queue (SOMAXCONN) is drained fast enough.
constexpr int kAcceptBatch = 256;
// How often parked connections are checked for the idle timeout and removed
// backends, and the remote-input log's summary is flushed.
constexpr auto kSweepEvery = std::chrono::milliseconds(200);
// After the descriptor limit was hit with nothing left to evict.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
// A serving thread waits this long for the connection's next request before it
// parks the connection (back-to-back requests skip the event loop's hop).
constexpr int kLingerMs = 2;
constexpr size_t kUrgentThreads = 2;

std::string HostOf(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  else if (ss.ss_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof(buf));
  return buf;
}

const char* ChannelName(Channel c) {
  switch (c) {
    case Channel::TcpData: return "TCP data";
    case Channel::RdmaControl: return "RDMA control";
    case Channel::Notify: return "notify";
    case Channel::Heartbeat: return "heartbeat";
  }
  return "unknown";
}

int64_t MsUntil(std::chrono::steady_clock::time_point t, std::chrono::steady_clock::time_point now) {
  return std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1);
}

}  // namespace

Listener::Listener(const std::string& host, uint16_t port, HandshakeOptions opts, ListenerLimits limits)
    : opts_(std::move(opts)), limits_(limits), pool_(limits.serveThreads), urgentPool_(kUrgentThreads) {
  if (!opts_.secret.empty()) (void)HmacSha256(opts_.secret, "probe");  // fail now if libcrypto is missing
  listenFd_ = ListenTcp(host, port, &port_);
  epollFd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const int fl = ::fcntl(listenFd_, F_GETFL);
  if (epollFd_ < 0 || wakeFd_ < 0 || fl < 0 || ::fcntl(listenFd_, F_SETFL, fl | O_NONBLOCK) != 0 ||
      Arm(EPOLL_CTL_ADD, listenFd_, kListenId, EPOLLIN) != 0 || Arm(EPOLL_CTL_ADD, wakeFd_, kWakeId, EPOLLIN) != 0) {
    std::string e = std::strerror(errno);
    for (int fd : {listenFd_, epollFd_, wakeFd_})
      if (fd >= 0) ::close(fd);
    throw BadState("control plane: cannot set up the event loop of port " + std::to_string(port_) + ": " + e);
  }
  handlers_[Channel::Heartbeat] = NewHeartbeatSession;
  loop_ = std::thread([this] { Loop(); });
}

Listener::~Listener() { Stop(); }

void Listener::SetHandler(Channel channel, ChannelHandler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  handlers_[channel] = std::move(handler);
}

int Listener::Arm(int op, int fd, uint64_t id, uint32_t events) {
  struct epoll_event ev{};
  ev.events = events;
  ev.data.u64 = id;
  return ::epoll_ctl(epollFd_, op, fd, &ev);
}

void Listener::Stop() {
  if (stopped_.exchange(true)) return;
  stopping_.store(true);
  uint64_t one = 1;
  (void)!::write(wakeFd_, &one, sizeof(one));
  if (loop_.joinable()) loop_.join();
  {
    // Wake the threads inside a request; they end their connections.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, c] : served_) c->sock.Shutdown();
  }
  pool_.Stop();
  urgentPool_.Stop();
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> parked;
  {
    std::lock_guard<std::mutex> lock(mu_);
    parked.swap(served_);
  }
  parked.clear();
  pendingById_.clear();
  pending_.clear();
  for (int fd : {listenFd_, epollFd_, wakeFd_})
    if (fd >= 0) ::close(fd);
  listenFd_ = epollFd_ = wakeFd_ = -1;
  RemoteInputLog().Flush(true);  // what was suppressed is counted before the engine goes
}

// ------------------------------------------------------------- event loop
void Listener::Loop() {
  pthread_setname_np(pthread_self(), "mori-io-listen");
  struct epoll_event evs[kEventBatch];
  auto nextSweep = Clock::now() + kSweepEvery;
  while (!stopping_.load()) {
    auto now = Clock::now();
    int64_t waitMs = MsUntil(nextSweep, now);
    if (!pending_.empty()) waitMs = std::min(waitMs, MsUntil(pending_.front()->deadline, now));
    if (acceptPaused_) waitMs = std::min(waitMs, MsUntil(acceptPausedUntil_, now));
    int n = ::epoll_wait(epollFd_, evs, kEventBatch, static_cast<int>(waitMs));
    if (n < 0 && errno != EINTR) {
      MORI_ERROR("control plane: epoll_wait failed on port " << port_ << ": " << std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    now = Clock::now();
    std::vector<Conn*> ready;
    for (int i = 0; i < n; ++i) {
      const uint64_t id = evs[i].data.u64;
      if (id == kListenId) {
        AcceptReady(now);
      } else if (id == kWakeId) {
        uint64_t v;
        (void)!::read(wakeFd_, &v, sizeof(v));
      } else if (auto p = pendingById_.find(id); p != pendingById_.end()) {
        OnHandshakeEvent(p->second);
      } else {
        // A served connection: events of one that is being served or was
        // closed meanwhile are stale (its id is gone or it is not parked).
        std::lock_guard<std::mutex> lock(mu_);
        auto s = served_.find(id);
        if (s != served_.end() && s->second->state == State::Parked) {
          s->second->state = State::Dispatched;
          ready.push_back(s->second.get());
        }
      }
    }
    for (Conn* c : ready) Dispatch(c);
    ExpireHandshakes(now);
    if (acceptPaused_ && now >= acceptPausedUntil_ && Arm(EPOLL_CTL_ADD, listenFd_, kListenId, EPOLLIN) == 0)
      acceptPaused_ = false;
    if (now >= nextSweep) {
      Sweep(now);
      RemoteInputLog().Flush();
      nextSweep = now + kSweepEvery;
    }
  }
}

void Listener::AcceptReady(Clock::time_point now) {
  for (int i = 0; i < kAcceptBatch; ++i) {
    struct sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = ::accept4(listenFd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      if (e == EINTR || e == ECONNABORTED) continue;
      if (e == EAGAIN || e == EWOULDBLOCK) return;
      if ((e == EMFILE || e == ENFILE) && !pending_.empty()) {
        // Out of descriptors: an unauthenticated connection makes room, oldest first.
        MORI_WARN_REMOTE("(descriptor limit)", "control plane: out of file descriptors on port "
                                                   << port_ << "; closing the oldest unauthenticated connection (from "
                                                   << pending_.front()->address << ") to accept new ones");
        DropHandshake(pending_.front().get());
        continue;
      }
      // Nothing to evict (or another resource error): stop polling the
      // listening socket for a moment instead of spinning on it.
      MORI_WARN_REMOTE("(accept error)", "control plane: accept on port " << port_ << " failed: "
                                                                           << std::strerror(e) << "; pausing accepts");
      if (Arm(EPOLL_CTL_DEL, listenFd_, kListenId, 0) == 0) {
        acceptPaused_ = true;
        acceptPausedUntil_ = now + kAcceptPause;
      }
      return;
    }
    if (stopping_.load()) {
      ::close(fd);
      return;
    }
    if (pending_.size() >= limits_.maxHandshakes) {
      Conn* oldest = pending_.front().get();
      MORI_WARN_REMOTE("(handshake cap)", "control plane: " << limits_.maxHandshakes
                                                            << " connections are in the handshake on port " << port_
                                                            << "; closed the oldest (from " << oldest->address
                                                            << ", waiting for its " << oldest->hs->waitingFor()
                                                            << ") to make room (MORI_IO_MAX_HANDSHAKES)");
      DropHandshake(oldest);
    }
    auto c = std::make_unique<Conn>();
    c->id = nextId_++;
    c->sock = Socket(fd);
    c->address = HostOf(ss);
    c->hs = std::make_unique<ServerHandshake>(opts_, c->address);
    c->deadline = now + std::chrono::milliseconds(opts_.timeoutMs);
    if (Arm(EPOLL_CTL_ADD, fd, c->id, EPOLLIN | EPOLLRDHUP) != 0) continue;  // c closes the socket
    Conn* raw = c.get();
    pending_.push_back(std::move(c));
    raw->pendingPos = std::prev(pending_.end());
    pendingById_[raw->id] = raw;
  }
}

void Listener::DropHandshake(Conn* c) {
  (void)Arm(EPOLL_CTL_DEL, c->sock.fd(), c->id, 0);
  pendingById_.erase(c->id);
  pending_.erase(c->pendingPos);  // closes the socket
}

void Listener::OnHandshakeEvent(Conn* c) {
  switch (c->hs->Advance(c->sock)) {
    case ServerHandshake::Result::Pending:
      return;
    case ServerHandshake::Result::Failed:
      if (!stopping_.load())
        MORI_WARN_REMOTE(c->address, "control plane: dropped connection from "
                                         << c->address << " during handshake: " << c->hs->error());
      DropHandshake(c);
      return;
    case ServerHandshake::Result::Accepted:
      Promote(c);
      return;
  }
}

void Listener::ExpireHandshakes(Clock::time_point now) {
  while (!pending_.empty() && pending_.front()->deadline <= now) {
    Conn* c = pending_.front().get();
    MORI_WARN_REMOTE(c->address, "control plane: dropped connection from "
                                     << c->address << " during handshake: no complete handshake within "
                                     << opts_.timeoutMs << " ms (waiting for its " << c->hs->waitingFor()
                                     << "; MORI_IO_CP_TIMEOUT_MS)");
    DropHandshake(c);
  }
}

void Listener::Promote(Conn* c) {
  std::unique_ptr<Conn> own = std::move(*c->pendingPos);
  pending_.erase(c->pendingPos);
  pendingById_.erase(c->id);
  c->handshaking = false;
  c->peer = std::move(c->hs->peer());
  c->hs.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (served_.size() < limits_.maxConnections) {
      c->state = State::Dispatched;
      // Armed for errors only until it is parked: such events are ignored
      // while a serving thread has it.
      (void)Arm(EPOLL_CTL_MOD, c->sock.fd(), c->id, EPOLLONESHOT);
      served_[c->id] = std::move(own);
    }
  }
  if (own) {  // over the cap
    MORI_WARN_REMOTE("(connection cap)", "control plane: " << limits_.maxConnections
                                                           << " connections are open on port " << port_
                                                           << "; closed the new one from '" << c->peer.engineKey
                                                           << "' (" << c->address << ") (MORI_IO_MAX_CONNECTIONS)");
    (void)Arm(EPOLL_CTL_DEL, c->sock.fd(), c->id, 0);
    return;
  }
  Dispatch(c);
}

void Listener::Dispatch(Conn* c) {
  // Only the thread that holds a connection touches its session: the one
  // that made it (on the general pool) or the one this is posted to now.
  ServePool& pool = c->session && c->session->Urgent() ? urgentPool_ : pool_;
  pool.Post([this, c] { Serve(c); });
}

void Listener::Sweep(Clock::time_point now) {
  std::vector<Conn*> closing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto idle = std::chrono::milliseconds(opts_.idleTimeoutMs);
    for (auto& [id, c] : served_) {
      if (c->state != State::Parked || !c->session) continue;
      const bool ended = c->session->Ended();
      const bool idled = opts_.idleTimeoutMs > 0 && c->session->ClosesWhenIdle() && now - c->parkedAt >= idle;
      if (!ended && !idled) continue;
      c->state = State::Dispatched;
      c->closing = true;
      c->closeReason = ended ? "its backend was removed" : "idle for " + std::to_string(opts_.idleTimeoutMs) + " ms";
      closing.push_back(c.get());
    }
  }
  for (Conn* c : closing) Dispatch(c);
}

// ------------------------------------------------------- serving threads
void Listener::Serve(Conn* c) {
  bool keep = !c->closing && !stopping_.load();
  if (keep && !c->session) {
    ChannelHandler handler;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = handlers_.find(c->peer.channel);
      if (it != handlers_.end()) handler = it->second;
    }
    try {
      if (handler) c->session = handler(c->sock, c->peer);
    } catch (const std::exception& e) {
      MORI_WARN("control plane: cannot serve the " << ChannelName(c->peer.channel) << " connection from '"
                                                   << c->peer.engineKey << "' (" << c->address << "): " << e.what());
    }
    if (!c->session) {
      if (!handler)
        MORI_WARN_REMOTE(c->address, "control plane: no backend serves channel " << static_cast<int>(c->peer.channel)
                                                                               << " requested by '"
                                                                               << c->peer.engineKey << "'");
      keep = false;
    }
  }
  int waitMs = 0;  // first whatever is there now, then the linger
  while (keep && !stopping_.load()) {
    struct pollfd p{c->sock.fd(), POLLIN | POLLRDHUP, 0};
    int r = ::poll(&p, 1, waitMs);
    if (r == 0) break;
    if (r < 0) {
      if (errno == EINTR) continue;
      keep = false;
      break;
    }
    try {
      keep = c->session->OnReadable(c->sock, stopping_);
    } catch (const std::exception& e) {
      MORI_WARN_REMOTE(c->address, "control plane: " << ChannelName(c->peer.channel) << " connection from '"
                                                     << c->peer.engineKey << "' ended: " << e.what());
      keep = false;
    }
    waitMs = kLingerMs;
  }
  if (c->closing)
    MORI_INFO("control plane: closed the " << ChannelName(c->peer.channel) << " connection from '" << c->peer.engineKey
                                           << "' (" << c->address << "): " << c->closeReason);
  if (keep && !stopping_.load())
    Park(c);
  else
    Close(c);
}

void Listener::Park(Conn* c) {
  std::lock_guard<std::mutex> lock(mu_);
  c->state = State::Parked;
  c->parkedAt = Clock::now();
  // Under the lock: the sweep cannot hand it to another thread before it is
  // armed, and once armed this thread no longer touches it.
  if (Arm(EPOLL_CTL_MOD, c->sock.fd(), c->id, EPOLLIN | EPOLLRDHUP | EPOLLONESHOT) != 0) {
    c->state = State::Dispatched;
    c->closing = true;
    c->closeReason = std::string("epoll: ") + std::strerror(errno);
    Dispatch(c);
  }
}

void Listener::Close(Conn* c) {
  std::unique_ptr<Conn> own;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = served_.find(c->id);
    if (it == served_.end()) return;
    own = std::move(it->second);
    served_.erase(it);
  }
  (void)Arm(EPOLL_CTL_DEL, own->sock.fd(), own->id, 0);
  // `own` goes here: the session first, then the socket.
}

}  // namespace mori::io::net
