// Completion of GPU copies without a spinning thread.
//
// A transfer's status polls its event when asked (progress hook). In
// addition one background thread blocks (sleeping: blocking-sync events) on
// the events in submission order, so that statuses also complete when nobody
// polls them, pinned regions are released promptly, and target-side
// notifications are sent once the data has landed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "common/gpu_runtime.hpp"
#include "io/common.hpp"
#include "io/memory_table.hpp"
#include "io/notify_channel.hpp"
#include "io/p2p/stream_pool.hpp"

namespace mori::io::p2p {

// One in-flight copy: its event, and the local region kept registered until done.
class GpuCompletion {
 public:
  GpuCompletion(std::shared_ptr<StreamPool> pool, int device, gpuEvent_t event, RegionPin pin)
      : pool_(std::move(pool)), device_(device), event_(event), pin_(std::move(pin)) {}
  ~GpuCompletion() { pool_->ReleaseEvent(device_, event_); }
  // Non-blocking: updates `status` if the copy finished (or failed).
  void Poll(TransferStatus& status);
  // Blocking: waits for the copy, then updates `status` (may be null); returns the copy's result.
  gpuError_t Finish(TransferStatus* status);

 private:
  void Complete(TransferStatus* status, gpuError_t e);
  std::shared_ptr<StreamPool> pool_;
  int device_;
  gpuEvent_t event_;
  std::mutex mu_;
  bool done_ = false;
  RegionPin pin_;
};

class CompletionWaiter {
 public:
  explicit CompletionWaiter(NotificationSender* notifier);
  ~CompletionWaiter();
  // notifyTarget == nullptr: no notification.
  void Watch(std::shared_ptr<GpuCompletion> c, std::weak_ptr<TransferStatus> status, const EngineDesc* notifyTarget,
             TransferUniqueId uid);

 private:
  struct Item {
    std::shared_ptr<GpuCompletion> completion;
    std::weak_ptr<TransferStatus> status;
    bool notify;
    EngineDesc target;
    TransferUniqueId uid;
  };
  void Loop();
  NotificationSender* notifier_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mori::io::p2p
