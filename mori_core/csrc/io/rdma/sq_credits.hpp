// Send-queue admission for one QP.
//
// With selective signalling the NIC frees SQ slots only when a signalled WR
// completes, and that completion frees every slot of its chain at once. A
// poster takes `n` slots before ibv_post_send and the completion poller gives
// them back; a poster that cannot get its slots within the backoff window
// fails its transfer instead of overrunning the queue or waiting forever.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace mori::io::rdma {

class SqCredits {
 public:
  explicit SqCredits(uint32_t depth) : depth_(depth), free_(depth) {}

  uint32_t depth() const { return depth_; }

  enum class Result { Ok, TimedOut, Aborted, TooLarge };

  Result Acquire(uint32_t n, int64_t timeoutUs) {
    if (n > depth_) return Result::TooLarge;
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = cv_.wait_for(lock, std::chrono::microseconds(timeoutUs), [&] { return aborted_ || free_ >= n; });
    if (aborted_) return Result::Aborted;
    if (!ok) return Result::TimedOut;
    free_ -= n;
    return Result::Ok;
  }

  void Release(uint32_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_ = free_ + n > depth_ ? depth_ : free_ + n;
    }
    cv_.notify_all();
  }

  // The QP is gone or in error: every waiter (now and later) fails at once.
  void Abort() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted_ = true;
    }
    cv_.notify_all();
  }

  uint32_t Available() const {
    std::lock_guard<std::mutex> lock(mu_);
    return free_;
  }

 private:
  const uint32_t depth_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint32_t free_;
  bool aborted_ = false;
};

}  // namespace mori::io::rdma
