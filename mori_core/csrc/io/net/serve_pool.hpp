// The threads that serve the listener's connections: at most `maxThreads`,
// started when work arrives and none is free, each ending after a quiet spell,
// so an idle listener holds none and a flood of connections cannot multiply
// them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>

namespace mori::io::net {

class ServePool {
 public:
  explicit ServePool(size_t maxThreads, std::chrono::milliseconds idleExit = std::chrono::seconds(10));
  ~ServePool();
  ServePool(const ServePool&) = delete;
  ServePool& operator=(const ServePool&) = delete;

  // Queues a task; it runs on a free thread, a new one while fewer than
  // maxThreads run, else once one is free.
  void Post(std::function<void()> task);
  // Runs what is queued, then joins every thread. Post must not be called after.
  void Stop();
  size_t Threads();

 private:
  struct Worker {
    std::thread thread;
    bool finished = false;
  };
  void Run(std::list<Worker>::iterator self);

  const size_t maxThreads_;
  const std::chrono::milliseconds idleExit_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::list<Worker> workers_;
  size_t live_ = 0;
  size_t idle_ = 0;
  bool stop_ = false;
};

}  // namespace mori::io::net
