#include "io/rdma/completion_poller.hpp"

#include <poll.h>

#include <algorithm>
#include <chrono>

#include "common/logging.hpp"

namespace mori::io::rdma {
namespace {

constexpr int64_t kWatchdogPeriodMs = 100;
constexpr int kSpinPasses = 1024;
constexpr int kMaxIdleSleepUs = 200;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

CompletionPoller::CompletionPoller(PollCqMode mode, std::vector<NicPtr> nics, int64_t stallTimeoutMs)
    : mode_(mode), nics_(std::move(nics)), stallTimeoutMs_(stallTimeoutMs) {
  thread_ = std::thread([this] { Loop(); });
}

CompletionPoller::~CompletionPoller() { Stop("the RDMA backend is shutting down"); }

void CompletionPoller::Add(const QpPtr& qp) {
  std::lock_guard<std::mutex> lock(mu_);
  qps_.push_back(qp);
  version_.fetch_add(1);
}

void CompletionPoller::Remove(const QueuePair* qp) {
  std::lock_guard<std::mutex> lock(mu_);
  qps_.erase(std::remove_if(qps_.begin(), qps_.end(), [&](const QpPtr& p) { return p.get() == qp; }), qps_.end());
  version_.fetch_add(1);
}

size_t CompletionPoller::Size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return qps_.size();
}

void CompletionPoller::Stop(const std::string& reason) {
  if (!stop_.exchange(true) && thread_.joinable()) thread_.join();
  std::vector<QpPtr> qps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    qps.swap(qps_);
    version_.fetch_add(1);
  }
  for (auto& q : qps) q->Shutdown(reason);
}

void CompletionPoller::PollingPass(const std::vector<QpPtr>& snap, int64_t now, int* got) {
  for (const auto& q : snap) *got += q->Poll(now);
}

void CompletionPoller::EventWait(const std::vector<QpPtr>& snap, int* got) {
  std::vector<struct pollfd> fds;
  for (const auto& n : nics_)
    if (n->channel) fds.push_back({n->channel->fd, POLLIN, 0});
  if (!fds.empty() && ::poll(fds.data(), fds.size(), static_cast<int>(kWatchdogPeriodMs)) > 0) {
    for (const auto& n : nics_) {
      if (!n->channel) continue;
      abi::ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      // The channel fd is non-blocking: this drains what is pending. Events
      // are acknowledged at once (ibv_destroy_cq waits for that).
      while (n->verbs.get_cq_event(n->channel, &cq, &ctx) == 0) n->verbs.ack_cq_events(cq, 1);
    }
  }
  // Every CQ is re-armed before it is drained, so a completion racing the
  // drain raises a new event; QPs added since the last pass are armed here too.
  const int64_t now = SteadyNowMs();
  for (const auto& q : snap) {
    q->RequestNotify();
    int n;
    while ((n = q->Poll(now)) > 0) *got += n;
  }
}

void CompletionPoller::Loop() {
  std::vector<QpPtr> snap;
  uint64_t seen = ~0ull;
  int64_t lastWatchdog = SteadyNowMs();
  int idlePasses = 0;
  int sleepUs = 1;
  while (!stop_.load(std::memory_order_relaxed)) {
    if (version_.load() != seen) {
      std::vector<QpPtr> fresh;
      {
        std::lock_guard<std::mutex> lock(mu_);
        fresh = qps_;
        seen = version_.load();
      }
      snap.swap(fresh);  // QPs dropped from the list are destroyed here, outside the lock
    }
    int64_t now = SteadyNowMs();
    int got = 0;
    if (mode_ == PollCqMode::EVENT) EventWait(snap, &got);
    else PollingPass(snap, now, &got);
    if (now - lastWatchdog >= kWatchdogPeriodMs) {
      lastWatchdog = now;
      for (const auto& q : snap) q->CheckStall(now, stallTimeoutMs_);
    }
    if (mode_ == PollCqMode::EVENT) continue;
    if (got > 0) {
      idlePasses = 0;
      sleepUs = 1;
      continue;
    }
    if (++idlePasses < kSpinPasses) {
      CpuRelax();
      continue;
    }
    bool busy = std::any_of(snap.begin(), snap.end(),
                            [](const QpPtr& q) { return q->role() == QueuePair::Role::Initiator && q->Busy(); });
    if (busy) {
      idlePasses = kSpinPasses / 2;  // keep spinning while transfers are in flight
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleepUs));
      sleepUs = std::min(sleepUs * 2, kMaxIdleSleepUs);
    }
  }
  snap.clear();
}

}  // namespace mori::io::rdma
