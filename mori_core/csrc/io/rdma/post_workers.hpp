// Posting threads (RdmaBackendConfig.num_worker_threads > 1).
//
// Work for a QP always goes to the same thread (by the QP's serial number),
// so each QP is fed by one thread in submission order — concurrent posting
// to one QP is what broke multi-QP DeepEP on RoCE (DeepEP #137) — while
// different QPs are posted in parallel.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace mori::io::rdma {

class PostWorkers {
 public:
  // A task runs with cancelled=true when the pool stops before running it;
  // it must then resolve its work without posting.
  using Task = std::function<void(bool cancelled)>;

  explicit PostWorkers(int threads);
  ~PostWorkers();
  PostWorkers(const PostWorkers&) = delete;
  PostWorkers& operator=(const PostWorkers&) = delete;

  void Enqueue(uint64_t key, Task task);
  void Stop();
  int size() const { return static_cast<int>(workers_.size()); }

 private:
  struct Worker {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> queue;
    bool stop = false;
    std::thread thread;
  };
  static void Run(Worker* w);
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace mori::io::rdma
