// Completion of GPU copies without a thread wake-up per transfer.
//
// A copy finishes in one of two observable ways: the scatter-copy kernel
// writes its signal slot (host memory), or a copy-engine copy's event
// completes. Whoever asks first sees it: the caller's Wait/WaitFor (the
// status's progress hook polls, no driver call for kernels), or one background
// thread that polls every transfer in flight with short sleeps, so statuses
// also complete when nobody asks, pinned regions are released, and target
// notifications are sent. Submitting never wakes that thread while it is
// polling; it is woken only when it had parked after a quiet spell.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/gpu_runtime.hpp"
#include "io/common.hpp"
#include "io/memory_table.hpp"
#include "io/notify_channel.hpp"
#include "io/p2p/stream_pool.hpp"

namespace mori::io::p2p {

// One in-flight copy (one launch, or copy-engine copies behind one event) and
// the local regions kept registered until it is done. Several transfers of a
// batch may share it: each polls it with its own status.
class GpuCompletion {
 public:
  // `stream` runs the copy proxy's resident grid: it drains between busy
  // periods, so a drained stream does not mean this copy ran.
  static constexpr bool kPersistentStream = true;
  // Done when the kernel on `stream` writes `slot`; `table` (may be null) is
  // the launch's segment table, returned to the device's pool once done.
  GpuCompletion(std::shared_ptr<StreamPool> pool, StreamPool::Device* device, gpuStream_t stream,
                SignalSlots::Slot slot, std::vector<RegionPin> pins, bool persistentStream = false,
                std::unique_ptr<SegmentTable> table = nullptr);
  // Done when `event` (recorded after copy-engine copies) completes.
  GpuCompletion(std::shared_ptr<StreamPool> pool, int device, gpuEvent_t event, std::vector<RegionPin> pins);
  ~GpuCompletion();
  GpuCompletion(const GpuCompletion&) = delete;
  GpuCompletion& operator=(const GpuCompletion&) = delete;

  // Non-blocking. Once the copy finished (or failed) updates `status` (may be
  // null) with the outcome and returns true, on every later call too (each
  // transfer sharing the copy reports it on its own status).
  bool Poll(TransferStatus* status);
  bool Succeeded();

 private:
  gpuError_t Check();  // gpuSuccess: done, gpuErrorNotReady: pending, else the failure
  void Report(TransferStatus* status) const;
  std::shared_ptr<StreamPool> pool_;
  StreamPool::Device* device_ = nullptr;
  int deviceId_ = -1;
  gpuStream_t stream_ = nullptr;
  SignalSlots::Slot slot_;
  gpuEvent_t event_ = nullptr;
  std::unique_ptr<SegmentTable> table_;
  int64_t nextStreamCheckNs_ = 0;
  bool persistentStream_ = false;
  bool lost_ = false;  // the proxy's stream drained without this copy's signal
  std::mutex mu_;
  bool done_ = false;
  gpuError_t result_ = gpuSuccess;
  std::vector<RegionPin> pins_;
};

class CompletionWaiter {
 public:
  explicit CompletionWaiter(NotificationSender* notifier);
  // Waits (bounded) for what is still in flight and sends its notifications.
  ~CompletionWaiter();
  // notifyTarget == nullptr: no notification.
  void Watch(std::shared_ptr<GpuCompletion> c, std::weak_ptr<TransferStatus> status,
             std::shared_ptr<const EngineDesc> notifyTarget, TransferUniqueId uid);

  struct Item {
    std::shared_ptr<GpuCompletion> completion;
    std::weak_ptr<TransferStatus> status;
    std::shared_ptr<const EngineDesc> notifyTarget;
    TransferUniqueId uid;
  };
  // Watch for every item of one launch: one lock and at most one wake-up (a batch of 66
  // region pairs took the lock, and could wake the thread, 66 times).
  void WatchAll(std::vector<Item>&& items);

 private:
  void Loop();
  NotificationSender* notifier_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> incoming_;
  bool parked_ = false;  // the thread sleeps until Watch() or stop
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mori::io::p2p
