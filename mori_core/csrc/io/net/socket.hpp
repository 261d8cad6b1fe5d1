// Thin RAII wrapper over a connected TCP socket with bounded waits.
//
// Every blocking call takes a "no progress" timeout: a peer that stops
// sending or receiving for that long ends the call with an error instead of
// hanging the thread. All failures return false with a readable reason.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace mori::io::net {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.fd_), lowWater_(o.lowWater_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { Close(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Close();
  // Wakes every thread blocked on this socket (they see an error) without
  // releasing the descriptor, which stays owned by this object.
  void Shutdown();

  // Send/receive exactly the given bytes. timeoutMs bounds each wait for
  // progress (< 0 = no bound). `stop`, when given, is checked between waits.
  bool SendAll(const void* data, size_t n, int64_t timeoutMs, std::string* err);
  bool SendV(const struct iovec* iov, size_t count, int64_t timeoutMs, std::string* err);
  // Sends as much of iov[*idx...] as the socket takes without blocking and
  // advances *idx / the iovecs in place. Returns 1 when everything went out,
  // 0 when the socket is full (call again, e.g. with SendV), -1 on error.
  int SendVNow(std::vector<struct iovec>& iov, size_t* idx, std::string* err);
  bool RecvAll(void* data, size_t n, int64_t timeoutMs, std::string* err,
               const std::atomic<bool>* stop = nullptr);
  bool RecvV(const struct iovec* iov, size_t count, int64_t timeoutMs, std::string* err);
  // Receives at least one and at most n bytes, waiting up to timeoutMs for
  // the first; returns the count, or -1 with *err.
  ssize_t RecvSome(void* data, size_t n, int64_t timeoutMs, std::string* err,
                   const std::atomic<bool>* stop = nullptr);
  // Reads and discards n bytes (keeps a stream in sync after a refused frame).
  bool Discard(uint64_t n, int64_t timeoutMs, std::string* err);

  // Socket options used by the data plane.
  void ConfigureForBulk(int bufBytes, int64_t userTimeoutMs);

 private:
  bool WaitFor(short events, int64_t timeoutMs, std::string* err, const std::atomic<bool>* stop);
  void SetLowWater(size_t missing);
  int fd_ = -1;
  int lowWater_ = 1;
};

// Connects with a bounded wait; throws mori::BadState naming host, port and cause.
Socket ConnectTcp(const std::string& host, uint16_t port, int64_t timeoutMs);

// Binds and listens; returns the fd and stores the bound port (for port 0).
// Throws mori::BadState naming the address on failure (e.g. port in use).
int ListenTcp(const std::string& host, uint16_t port, uint16_t* boundPort);

// An IPv4 address of this host that peers can reach ("127.0.0.1" fallback).
std::string DefaultAdvertiseAddress();

}  // namespace mori::io::net
