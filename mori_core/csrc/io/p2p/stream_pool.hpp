// Per-device GPU resources of the XGMI backend: streams (round robin),
// completion events for copy-engine copies (reused), completion signal
// slots and segment tables for the scatter-copy kernel, and the optional copy
// proxy.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/gpu_runtime.hpp"
#include "io/p2p/copy_proxy.hpp"
#include "io/p2p/scatter_copy.hpp"
#include "io/p2p/signal_slots.hpp"

namespace mori::io::p2p {

class StreamPool {
 public:
  // One device's resources; its address is stable, so sessions keep a pointer
  // and pick streams without a lock or a lookup.
  struct Device {
    explicit Device(int d) : signals(d), tables(d) {}
    std::vector<gpuStream_t> streams;
    std::atomic<size_t> next{0};
    SignalSlots signals;
    SegmentTablePool tables;  // descriptors of launches with more than kParamSegments segments
    std::unique_ptr<CopyProxy> proxy;  // null unless enabled; declared after `signals`: its grid writes them
    gpuStream_t NextStream() { return streams[next.fetch_add(1, std::memory_order_relaxed) % streams.size()]; }
  };

  StreamPool(int streamsPerDevice, int eventsPerDevice, const ProxyConfig& proxy = {});
  ~StreamPool();
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;

  // Creates the device's streams on first use (caller has `device` current).
  Device& ForDevice(int device);
  gpuEvent_t AcquireEvent(int device);
  void ReleaseEvent(int device, gpuEvent_t e);

 private:
  const int streamsPerDevice_;
  const int eventsPerDevice_;
  const ProxyConfig proxy_;
  std::mutex mu_;
  std::unordered_map<int, std::unique_ptr<Device>> devices_;
  std::unordered_map<int, std::vector<gpuEvent_t>> freeEvents_;
};

}  // namespace mori::io::p2p
