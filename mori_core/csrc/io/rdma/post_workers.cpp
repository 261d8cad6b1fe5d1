#include "io/rdma/post_workers.hpp"

#include <memory>

namespace mori::io::rdma {

PostWorkers::PostWorkers(int threads) {
  for (int i = 0; i < threads; ++i) {
    workers_.push_back(std::make_unique<Worker>());
    Worker* w = workers_.back().get();
    w->thread = std::thread([w] { Run(w); });
  }
}

PostWorkers::~PostWorkers() { Stop(); }

void PostWorkers::Run(Worker* w) {
  while (true) {
    Task t;
    {
      std::unique_lock<std::mutex> lock(w->mu);
      w->cv.wait(lock, [&] { return w->stop || !w->queue.empty(); });
      if (w->queue.empty()) return;  // stopping and drained
      t = std::move(w->queue.front());
      w->queue.pop_front();
      if (w->stop) {
        lock.unlock();
        t(true);
        continue;
      }
    }
    t(false);
  }
}

void PostWorkers::Enqueue(uint64_t key, Task task) {
  Worker* w = workers_[key % workers_.size()].get();
  {
    std::lock_guard<std::mutex> lock(w->mu);
    if (!w->stop) {
      w->queue.push_back(std::move(task));
      w->cv.notify_one();
      return;
    }
  }
  task(true);
}

void PostWorkers::Stop() {
  for (auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->mu);
    w->stop = true;
    w->cv.notify_one();
  }
  for (auto& w : workers_)
    if (w->thread.joinable()) w->thread.join();
}

}  // namespace mori::io::rdma
