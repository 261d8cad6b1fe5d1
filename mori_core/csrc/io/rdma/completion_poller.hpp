// The one thread that reaps completions of every QP of a backend.
//
// POLLING mode spins over all CQs while any initiator QP has work in flight
// (lowest latency) and backs off to short sleeps when idle, so an idle engine
// does not burn a core. EVENT mode sleeps in poll() on the NICs' completion
// channels. Both run the stall watchdog every 100 ms, so every transfer ends
// within bounded time even when a device stops reporting completions.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/rdma/nic.hpp"
#include "io/rdma/queue_pair.hpp"

namespace mori::io::rdma {

class CompletionPoller {
 public:
  CompletionPoller(PollCqMode mode, std::vector<NicPtr> nics, int64_t stallTimeoutMs);
  ~CompletionPoller();
  CompletionPoller(const CompletionPoller&) = delete;
  CompletionPoller& operator=(const CompletionPoller&) = delete;

  void Add(const QpPtr& qp);
  void Remove(const QueuePair* qp);
  // Stops the thread and fails whatever is still outstanding on every QP.
  void Stop(const std::string& reason);
  size_t Size() const;

 private:
  void Loop();
  void PollingPass(const std::vector<QpPtr>& snap, int64_t now, int* got);
  void EventWait(const std::vector<QpPtr>& snap, int* got);

  const PollCqMode mode_;
  const std::vector<NicPtr> nics_;
  const int64_t stallTimeoutMs_;
  mutable std::mutex mu_;
  std::vector<QpPtr> qps_;
  std::atomic<uint64_t> version_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace mori::io::rdma
