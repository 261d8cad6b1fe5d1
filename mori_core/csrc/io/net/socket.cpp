#include "io/net/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "common/error.hpp"

namespace mori::io::net {
namespace {

std::string ErrnoText(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

constexpr int64_t kStopPollMs = 200;

}  // namespace

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    Close();
    fd_ = o.fd_;
    lowWater_ = o.lowWater_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::Close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void Socket::Shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

bool Socket::WaitFor(short events, int64_t timeoutMs, std::string* err, const std::atomic<bool>* stop) {
  using Clock = std::chrono::steady_clock;
  auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs < 0 ? 0 : timeoutMs);
  while (true) {
    int64_t waitMs = timeoutMs < 0 ? kStopPollMs
                                   : std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (timeoutMs >= 0 && waitMs <= 0) {
      if (err) *err = "timed out after " + std::to_string(timeoutMs) + " ms without progress";
      return false;
    }
    if (stop) waitMs = std::min<int64_t>(waitMs, kStopPollMs);
    struct pollfd p{fd_, events, 0};
    int r = ::poll(&p, 1, static_cast<int>(waitMs));
    if (r > 0) return true;  // readable/writable or an error the next call reports
    if (r < 0 && errno != EINTR) {
      if (err) *err = ErrnoText("poll");
      return false;
    }
    if (stop && stop->load()) {
      if (err) *err = "engine is shutting down";
      return false;
    }
  }
}

bool Socket::SendAll(const void* data, size_t n, int64_t timeoutMs, std::string* err) {
  struct iovec iov{const_cast<void*>(data), n};
  return SendV(&iov, 1, timeoutMs, err);
}

int Socket::SendVNow(std::vector<struct iovec>& iov, size_t* idx, std::string* err) {
  while (*idx < iov.size()) {
    if (iov[*idx].iov_len == 0) {
      ++*idx;
      continue;
    }
    struct msghdr msg{};
    msg.msg_iov = &iov[*idx];
    msg.msg_iovlen = std::min<size_t>(iov.size() - *idx, IOV_MAX);
    ssize_t w = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      if (err) *err = ErrnoText("send");
      return -1;
    }
    size_t left = static_cast<size_t>(w);
    while (left > 0 && *idx < iov.size()) {
      size_t take = std::min(left, iov[*idx].iov_len);
      iov[*idx].iov_base = static_cast<uint8_t*>(iov[*idx].iov_base) + take;
      iov[*idx].iov_len -= take;
      left -= take;
      if (iov[*idx].iov_len == 0) ++*idx;
    }
  }
  return 1;
}

bool Socket::SendV(const struct iovec* iovIn, size_t count, int64_t timeoutMs, std::string* err) {
  std::vector<struct iovec> iov(iovIn, iovIn + count);
  size_t idx = 0;
  while (true) {
    int r = SendVNow(iov, &idx, err);
    if (r != 0) return r == 1;
    if (!WaitFor(POLLOUT, timeoutMs, err, nullptr)) return false;
  }
}

bool Socket::RecvAll(void* data, size_t n, int64_t timeoutMs, std::string* err, const std::atomic<bool>* stop) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    ssize_t r = ::recv(fd_, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) {
      if (err) *err = "connection closed by peer";
      return false;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      SetLowWater(n);
      bool ok = WaitFor(POLLIN, timeoutMs, err, stop);
      SetLowWater(1);
      if (!ok) return false;
      continue;
    }
    if (err) *err = ErrnoText("recv");
    return false;
  }
  return true;
}

ssize_t Socket::RecvSome(void* data, size_t n, int64_t timeoutMs, std::string* err, const std::atomic<bool>* stop) {
  while (true) {
    ssize_t r = ::recv(fd_, data, n, MSG_DONTWAIT);
    if (r > 0) return r;
    if (r == 0) {
      if (err) *err = "connection closed by peer";
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      if (err) *err = ErrnoText("recv");
      return -1;
    }
    if (!WaitFor(POLLIN, timeoutMs, err, stop)) return -1;
  }
}

void Socket::SetLowWater(size_t missing) {
  // Wake the waiting thread once (most of) the missing bytes are there
  // instead of once per arriving segment; capped well below the receive
  // buffer so the sender never stalls on it.
  int want = static_cast<int>(std::min<size_t>(missing, 256 << 10));
  if (want == lowWater_) return;
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want));
  lowWater_ = want;
}

bool Socket::RecvV(const struct iovec* iovIn, size_t count, int64_t timeoutMs, std::string* err) {
  std::vector<struct iovec> iov(iovIn, iovIn + count);
  size_t idx = 0;
  while (idx < iov.size()) {
    if (iov[idx].iov_len == 0) {
      ++idx;
      continue;
    }
    struct msghdr msg{};
    msg.msg_iov = &iov[idx];
    msg.msg_iovlen = std::min<size_t>(iov.size() - idx, IOV_MAX);
    ssize_t r = ::recvmsg(fd_, &msg, MSG_DONTWAIT);
    if (r == 0) {
      if (err) *err = "connection closed by peer";
      return false;
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        size_t missing = 0;
        for (size_t i = idx; i < iov.size(); ++i) missing += iov[i].iov_len;
        SetLowWater(missing);
        bool ok = WaitFor(POLLIN, timeoutMs, err, nullptr);
        SetLowWater(1);
        if (!ok) return false;
        continue;
      }
      if (err) *err = ErrnoText("recv");
      return false;
    }
    size_t left = static_cast<size_t>(r);
    while (left > 0 && idx < iov.size()) {
      size_t take = std::min(left, iov[idx].iov_len);
      iov[idx].iov_base = static_cast<uint8_t*>(iov[idx].iov_base) + take;
      iov[idx].iov_len -= take;
      left -= take;
      if (iov[idx].iov_len == 0) ++idx;
    }
  }
  return true;
}

bool Socket::Discard(uint64_t n, int64_t timeoutMs, std::string* err) {
  std::vector<uint8_t> sink(std::min<uint64_t>(n, 1 << 20));
  while (n > 0) {
    size_t take = static_cast<size_t>(std::min<uint64_t>(n, sink.size()));
    if (!RecvAll(sink.data(), take, timeoutMs, err)) return false;
    n -= take;
  }
  return true;
}

void Socket::ConfigureForBulk(int bufBytes, int64_t userTimeoutMs) {
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (bufBytes > 0) {
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &bufBytes, sizeof(bufBytes));
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &bufBytes, sizeof(bufBytes));
  }
  // Detect a vanished host (no FIN/RST) within a few seconds of silence.
  ::setsockopt(fd_, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 1, intvl = 1, cnt = 2;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  ::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  if (userTimeoutMs > 0) {
    unsigned int ut = static_cast<unsigned int>(userTimeoutMs);
    ::setsockopt(fd_, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof(ut));
  }
}

Socket ConnectTcp(const std::string& host, uint16_t port, int64_t timeoutMs) {
  const std::string where = host + ":" + std::to_string(port);
  struct addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* res = nullptr;
  int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0) throw BadState("cannot resolve " + where + ": " + ::gai_strerror(gai));
  std::string lastErr = "no address";
  for (auto* ai = res; ai; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      lastErr = ErrnoText("socket");
      continue;
    }
    Socket s(fd);
    int r = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (r < 0 && errno != EINPROGRESS) {
      lastErr = ErrnoText("connect");
      continue;
    }
    if (r < 0) {
      struct pollfd p{fd, POLLOUT, 0};
      int pr = ::poll(&p, 1, static_cast<int>(timeoutMs));
      if (pr <= 0) {
        lastErr = pr == 0 ? "connect timed out after " + std::to_string(timeoutMs) + " ms" : ErrnoText("poll");
        continue;
      }
      int soerr = 0;
      socklen_t len = sizeof(soerr);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
      if (soerr != 0) {
        lastErr = std::string("connect: ") + std::strerror(soerr);
        continue;
      }
    }
    ::freeaddrinfo(res);
    return s;
  }
  ::freeaddrinfo(res);
  throw BadState("cannot connect to " + where + ": " + lastErr);
}

int ListenTcp(const std::string& host, uint16_t port, uint16_t* boundPort) {
  const std::string bindHost = host.empty() ? "0.0.0.0" : host;
  const std::string where = bindHost + ":" + std::to_string(port);
  struct addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  struct addrinfo* res = nullptr;
  int gai = ::getaddrinfo(bindHost.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0) throw BadState("cannot resolve listen address " + where + ": " + ::gai_strerror(gai));
  int fd = ::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
  if (fd < 0) {
    ::freeaddrinfo(res);
    throw BadState("cannot listen on " + where + ": " + ErrnoText("socket"));
  }
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    std::string e = ErrnoText("bind/listen");
    ::close(fd);
    ::freeaddrinfo(res);
    throw BadState("cannot listen on " + where + " (" + e + ")");
  }
  ::freeaddrinfo(res);
  struct sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  if (ss.ss_family == AF_INET)
    *boundPort = ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  else
    *boundPort = ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return fd;
}

std::string DefaultAdvertiseAddress() {
  struct ifaddrs* ifs = nullptr;
  std::string found;
  if (::getifaddrs(&ifs) == 0) {
    for (auto* i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      auto* sin = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
      if ((ntohl(sin->sin_addr.s_addr) >> 24) == 127) continue;
      char buf[INET_ADDRSTRLEN];
      ::inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
      found = buf;
      break;
    }
    ::freeifaddrs(ifs);
  }
  return found.empty() ? "127.0.0.1" : found;
}

}  // namespace mori::io::net
