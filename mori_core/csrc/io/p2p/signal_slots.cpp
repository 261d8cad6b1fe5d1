#include "io/p2p/signal_slots.hpp"

#include "common/gpu_runtime.hpp"

namespace mori::io::p2p {

SignalSlots::~SignalSlots() {
  DeviceGuard g(device_);
  for (auto& c : chunks_) {
    (void)gpuFreeHost(c.host);
    (void)gpuFree(c.counters);
  }
}

void SignalSlots::Grow() {
  DeviceGuard g(device_);
  Chunk c;
  void* host = nullptr;
  MORI_GPU_CHECK(gpuHostAlloc(&host, kChunk * sizeof(uint32_t), gpuHostAllocMapped | gpuHostAllocPortable));
  c.host = static_cast<uint32_t*>(host);
  for (uint32_t i = 0; i < kChunk; ++i) c.host[i] = 0;
  void* dev = nullptr;
  gpuError_t e = gpuHostGetDevicePointer(&dev, host, 0);
  void* counters = nullptr;
  if (e == gpuSuccess) e = gpuMalloc(&counters, kChunk * sizeof(uint32_t));
  if (e == gpuSuccess) e = gpuMemset(counters, 0, kChunk * sizeof(uint32_t));
  if (e != gpuSuccess) {
    if (counters) (void)gpuFree(counters);
    (void)gpuFreeHost(host);
    MORI_GPU_CHECK(e);
  }
  c.device = static_cast<uint32_t*>(dev);
  c.counters = static_cast<uint32_t*>(counters);
  const auto base = static_cast<uint32_t>(chunks_.size() * kChunk);
  chunks_.push_back(c);
  generation_.resize(generation_.size() + kChunk, 0);
  for (uint32_t i = kChunk; i-- > 0;) free_.push_back(base + i);
}

SignalSlots::Slot SignalSlots::Acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) Grow();
  const uint32_t idx = free_.back();
  free_.pop_back();
  uint32_t& gen = generation_[idx];
  if (++gen == 0) gen = 1;  // 0 is the initial content of every word
  const Chunk& c = chunks_[idx / kChunk];
  Slot s;
  s.host = c.host + idx % kChunk;
  s.device = c.device + idx % kChunk;
  s.counter = c.counters + idx % kChunk;
  s.value = gen;
  s.index = idx;
  return s;
}

void SignalSlots::Release(const Slot& s) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(s.index);
}

}  // namespace mori::io::p2p
