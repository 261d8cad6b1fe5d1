#include "io/p2p/stream_pool.hpp"

namespace mori::io::p2p {

StreamPool::StreamPool(int streamsPerDevice, int eventsPerDevice)
    : streamsPerDevice_(streamsPerDevice), eventsPerDevice_(eventsPerDevice) {}

StreamPool::~StreamPool() {
  for (auto& [dev, d] : devices_) {
    DeviceGuard g(dev);
    for (auto s : d.streams) (void)gpuStreamDestroy(s);
    for (auto e : d.freeEvents) (void)gpuEventDestroy(e);
  }
}

StreamPool::PerDevice& StreamPool::Device(int device) {
  auto& d = devices_[device];
  if (d.streams.empty()) {
    d.streams.resize(static_cast<size_t>(streamsPerDevice_));
    for (auto& s : d.streams) MORI_GPU_CHECK(gpuStreamCreateWithFlags(&s, gpuStreamNonBlocking));
    for (int i = 0; i < eventsPerDevice_; ++i) {
      gpuEvent_t e;
      // Blocking-sync events: a thread waiting in EventSynchronize sleeps instead of spinning.
      MORI_GPU_CHECK(gpuEventCreateWithFlags(&e, gpuEventDisableTiming | gpuEventBlockingSync));
      d.freeEvents.push_back(e);
    }
  }
  return d;
}

gpuStream_t StreamPool::NextStream(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& d = Device(device);
  return d.streams[d.next++ % d.streams.size()];
}

gpuEvent_t StreamPool::AcquireEvent(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& d = Device(device);
  if (!d.freeEvents.empty()) {
    gpuEvent_t e = d.freeEvents.back();
    d.freeEvents.pop_back();
    return e;
  }
  gpuEvent_t e;  // pool exhausted (many transfers in flight): grow it
  MORI_GPU_CHECK(gpuEventCreateWithFlags(&e, gpuEventDisableTiming | gpuEventBlockingSync));
  return e;
}

void StreamPool::ReleaseEvent(int device, gpuEvent_t e) {
  std::lock_guard<std::mutex> lock(mu_);
  devices_[device].freeEvents.push_back(e);
}

}  // namespace mori::io::p2p
