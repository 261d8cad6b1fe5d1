#include "io/net/serve_pool.hpp"

#include <pthread.h>

#include <algorithm>

namespace mori::io::net {

ServePool::ServePool(size_t maxThreads, std::chrono::milliseconds idleExit)
    : maxThreads_(std::max<size_t>(maxThreads, 1)), idleExit_(idleExit) {}

ServePool::~ServePool() { Stop(); }

void ServePool::Post(std::function<void()> task) {
  std::list<Worker> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = workers_.begin(); it != workers_.end();) {
      auto next = std::next(it);
      if (it->finished) finished.splice(finished.end(), workers_, it);
      it = next;
    }
    queue_.push_back(std::move(task));
    if (queue_.size() > idle_ && live_ < maxThreads_) {
      workers_.emplace_back();
      auto self = std::prev(workers_.end());
      ++live_;
      self->thread = std::thread([this, self] { Run(self); });  // Run waits for mu_
    } else {
      cv_.notify_one();
    }
  }
  for (auto& w : finished) w.thread.join();
}

void ServePool::Run(std::list<Worker>::iterator self) {
  pthread_setname_np(pthread_self(), "mori-io-serve");
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (queue_.empty()) {
      if (stop_) break;
      ++idle_;
      bool woke = cv_.wait_for(lock, idleExit_, [&] { return stop_ || !queue_.empty(); });
      --idle_;
      if (!woke) break;  // a quiet spell: give the thread back
      continue;
    }
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // what it captured goes before the lock is taken again
    lock.lock();
  }
  --live_;
  self->finished = true;  // joined by the next Post or by Stop
}

void ServePool::Stop() {
  std::list<Worker> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  // Threads end once the queue is empty; take them only then, so none is
  // started behind this loop's back (Post is not called any more).
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      all.splice(all.end(), workers_);
    }
    if (all.empty()) break;
    for (auto& w : all) w.thread.join();
    all.clear();
  }
}

size_t ServePool::Threads() {
  std::lock_guard<std::mutex> lock(mu_);
  return live_;
}

}  // namespace mori::io::net
