#include "io/p2p/stream_pool.hpp"

namespace mori::io::p2p {

StreamPool::StreamPool(int streamsPerDevice, int eventsPerDevice, const ProxyConfig& proxy)
    : streamsPerDevice_(streamsPerDevice), eventsPerDevice_(eventsPerDevice), proxy_(proxy) {}

StreamPool::~StreamPool() {
  for (auto& [dev, d] : devices_) {
    DeviceGuard g(dev);
    d->proxy.reset();  // its grid leaves before the streams and signal words go
    for (auto s : d->streams) (void)gpuStreamDestroy(s);
  }
  for (auto& [dev, events] : freeEvents_) {
    DeviceGuard g(dev);
    for (auto e : events) (void)gpuEventDestroy(e);
  }
}

StreamPool::Device& StreamPool::ForDevice(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = devices_[device];
  if (!slot) {
    auto d = std::make_unique<Device>(device);
    d->streams.resize(static_cast<size_t>(streamsPerDevice_));
    for (auto& s : d->streams) MORI_GPU_CHECK(gpuStreamCreateWithFlags(&s, gpuStreamNonBlocking));
    auto& events = freeEvents_[device];
    for (int i = 0; i < eventsPerDevice_; ++i) {
      gpuEvent_t e;
      MORI_GPU_CHECK(gpuEventCreateWithFlags(&e, gpuEventDisableTiming));
      events.push_back(e);
    }
    if (proxy_.blocks > 0) d->proxy = std::make_unique<CopyProxy>(device, proxy_);
    slot = std::move(d);
  }
  return *slot;
}

gpuEvent_t StreamPool::AcquireEvent(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& events = freeEvents_[device];
  if (!events.empty()) {
    gpuEvent_t e = events.back();
    events.pop_back();
    return e;
  }
  gpuEvent_t e;  // pool exhausted (many transfers in flight): grow it
  MORI_GPU_CHECK(gpuEventCreateWithFlags(&e, gpuEventDisableTiming));
  return e;
}

void StreamPool::ReleaseEvent(int device, gpuEvent_t e) {
  std::lock_guard<std::mutex> lock(mu_);
  freeEvents_[device].push_back(e);
}

}  // namespace mori::io::p2p
