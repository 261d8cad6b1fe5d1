#include "io/p2p/completion_waiter.hpp"

namespace mori::io::p2p {

void GpuCompletion::Complete(TransferStatus* status, gpuError_t e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    pin_ = RegionPin();
  }
  if (!status) return;
  if (e == gpuSuccess)
    status->Update(StatusCode::SUCCESS);
  else
    status->Update(StatusCode::ERR_GPU_OP, std::string("GPU copy failed: ") + gpuGetErrorString(e));
}

void GpuCompletion::Poll(TransferStatus& status) {
  gpuError_t e = gpuEventQuery(event_);
  if (e == gpuErrorNotReady) return;
  if (e != gpuSuccess) (void)gpuGetLastError();
  Complete(&status, e);
}

gpuError_t GpuCompletion::Finish(TransferStatus* status) {
  gpuError_t e = gpuEventSynchronize(event_);
  if (e != gpuSuccess) (void)gpuGetLastError();
  Complete(status, e);
  return e;
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
                             const EngineDesc* notifyTarget, TransferUniqueId uid) {
  Item item{std::move(c), std::move(status), notifyTarget != nullptr, notifyTarget ? *notifyTarget : EngineDesc{},
            uid};
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(item));
  }
  cv_.notify_one();
}

void CompletionWaiter::Loop() {
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ with nothing left
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    auto status = item.status.lock();
    gpuError_t e = item.completion->Finish(status.get());
    if (item.notify && e == gpuSuccess) notifier_->Notify(item.target, item.uid);
  }
}

}  // namespace mori::io::p2p
