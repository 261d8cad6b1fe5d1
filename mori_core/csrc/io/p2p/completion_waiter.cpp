#include "io/p2p/completion_waiter.hpp"

#include <sys/prctl.h>

#include <chrono>

#include "common/logging.hpp"
#include "io/submit_profile.hpp"

namespace mori::io::p2p {
namespace {

// A kernel that faulted never writes its signal; its stream then reports the
// error. Streams are asked only this long after submission and as often,
// so healthy copies cost no driver call at all.
constexpr int64_t kStreamCheckNs = 1000000;
// The background thread polls every kPollTick while copies are in flight,
// looks for new ones every kLingerTick for kLinger after the last one (so a
// steady stream of transfers never pays a wake-up), then parks.
constexpr auto kPollTick = std::chrono::microseconds(20);
constexpr auto kLingerTick = std::chrono::microseconds(100);
constexpr auto kLinger = std::chrono::milliseconds(5);
// Destruction waits this long for copies in flight (a hung GPU must not hang exit).
constexpr auto kDrainTimeout = std::chrono::seconds(30);

}  // namespace

GpuCompletion::GpuCompletion(std::shared_ptr<StreamPool> pool, StreamPool::Device* device, gpuStream_t stream,
                             SignalSlots::Slot slot, std::vector<RegionPin> pins, bool persistentStream,
                             std::unique_ptr<SegmentTable> table)
    : pool_(std::move(pool)),
      device_(device),
      stream_(stream),
      slot_(slot),
      table_(std::move(table)),
      nextStreamCheckNs_(profile::NowNs() + kStreamCheckNs),
      persistentStream_(persistentStream),
      pins_(std::move(pins)) {}

GpuCompletion::GpuCompletion(std::shared_ptr<StreamPool> pool, int device, gpuEvent_t event, std::vector<RegionPin> pins)
    : pool_(std::move(pool)), deviceId_(device), event_(event), pins_(std::move(pins)) {}

// A completion that never finished (abandoned at shutdown) keeps its slot or
// event out of circulation: the GPU may still write the slot.
GpuCompletion::~GpuCompletion() = default;

gpuError_t GpuCompletion::Check() {
  if (slot_) {
    if (slot_.Signalled()) return gpuSuccess;
    const int64_t now = profile::NowNs();
    if (now < nextStreamCheckNs_) return gpuErrorNotReady;
    nextStreamCheckNs_ = now + kStreamCheckNs;
    // A drained stream means the kernel ended; a sticky error means it failed.
    gpuError_t e = gpuStreamQuery(stream_);
    if (e == gpuSuccess || e == gpuErrorNotReady) {
      if (slot_.Signalled()) return gpuSuccess;
      // The proxy's grid left with this copy posted: a protocol failure, never success.
      if (e == gpuSuccess && persistentStream_) lost_ = true;
      return e;
    }
    (void)gpuGetLastError();
    return e;
  }
  gpuError_t e = gpuEventQuery(event_);
  if (e != gpuSuccess && e != gpuErrorNotReady) (void)gpuGetLastError();
  return e;
}

bool GpuCompletion::Poll(TransferStatus* status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      gpuError_t e = Check();
      if (e == gpuErrorNotReady) return false;
      done_ = true;
      result_ = e;
      pins_.clear();
      if (slot_) {
        // The slot's word and the segment table are reused only when this
        // kernel provably finished with them; after a failure (or a stream
        // that drained without the signal) the slot is retired and the table
        // freed with this object.
        if (e == gpuSuccess && slot_.Signalled()) {
          device_->signals.Release(slot_);
          device_->tables.Release(std::move(table_));
        }
      } else {
        pool_->ReleaseEvent(deviceId_, event_);
      }
    }
  }
  Report(status);
  return true;
}

void GpuCompletion::Report(TransferStatus* status) const {
  if (!status) return;
  if (lost_)
    status->Update(StatusCode::ERR_GPU_OP, "XGMI copy proxy stopped before this transfer was copied");
  else if (result_ == gpuSuccess)
    status->Update(StatusCode::SUCCESS);
  else
    status->Update(StatusCode::ERR_GPU_OP, std::string("GPU copy failed: ") + gpuGetErrorString(result_));
}

bool GpuCompletion::Succeeded() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ && result_ == gpuSuccess && !lost_;
}

CompletionWaiter::CompletionWaiter(NotificationSender* notifier)
    : notifier_(notifier), thread_([this] { Loop(); }) {}

CompletionWaiter::~CompletionWaiter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void CompletionWaiter::Watch(std::shared_ptr<GpuCompletion> c, std::weak_ptr<TransferStatus> status,
                             std::shared_ptr<const EngineDesc> notifyTarget, TransferUniqueId uid) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming_.push_back({std::move(c), std::move(status), std::move(notifyTarget), uid});
    wake = parked_;
  }
  if (wake) cv_.notify_one();
}

void CompletionWaiter::WatchAll(std::vector<Item>&& items) {
  if (items.empty()) return;
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Item& it : items) incoming_.push_back(std::move(it));
    wake = parked_;
  }
  if (wake) cv_.notify_one();
}

void CompletionWaiter::Loop() {
  // Short sleeps must stay short: the default 50 us timer slack would
  // stretch every poll tick.
  (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  using Clock = std::chrono::steady_clock;
  std::vector<Item> pending;
  auto lastWork = Clock::now();
  Clock::time_point drainDeadline = Clock::time_point::max();
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (pending.empty() && incoming_.empty()) {
        if (stop_) return;
        if (Clock::now() - lastWork >= kLinger) {
          parked_ = true;
          cv_.wait(lock, [&] { return stop_ || !incoming_.empty(); });
          parked_ = false;
        } else {
          cv_.wait_for(lock, kLingerTick, [&] { return stop_; });
        }
      }
      for (auto& it : incoming_) pending.push_back(std::move(it));
      incoming_.clear();
      if (stop_ && drainDeadline == Clock::time_point::max()) drainDeadline = Clock::now() + kDrainTimeout;
    }
    if (pending.empty()) continue;
    lastWork = Clock::now();
    size_t kept = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
      Item& item = pending[i];
      auto status = item.status.lock();
      if (item.completion->Poll(status.get())) {
        if (item.notifyTarget && item.completion->Succeeded()) notifier_->Notify(*item.notifyTarget, item.uid);
      } else {
        if (kept != i) pending[kept] = std::move(item);
        ++kept;
      }
    }
    pending.resize(kept);
    if (pending.empty()) continue;
    if (Clock::now() >= drainDeadline) {
      MORI_ERROR("XGMI: " << pending.size() << " GPU copies did not finish within 30 s of shutdown; abandoning them");
      // Their slots and pinned regions are intentionally leaked: the GPU may still write them.
      (void)new std::vector<Item>(std::move(pending));
      return;
    }
    std::this_thread::sleep_for(kPollTick);
  }
}

}  // namespace mori::io::p2p
