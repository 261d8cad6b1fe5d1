// Per-device pools of streams (round robin) and completion events (reused).
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/gpu_runtime.hpp"

namespace mori::io::p2p {

class StreamPool {
 public:
  StreamPool(int streamsPerDevice, int eventsPerDevice);
  ~StreamPool();
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;

  // Caller has `device` current.
  gpuStream_t NextStream(int device);
  gpuEvent_t AcquireEvent(int device);
  void ReleaseEvent(int device, gpuEvent_t e);

 private:
  struct PerDevice {
    std::vector<gpuStream_t> streams;
    size_t next = 0;
    std::vector<gpuEvent_t> freeEvents;
  };
  PerDevice& Device(int device);
  const int streamsPerDevice_;
  const int eventsPerDevice_;
  std::mutex mu_;
  std::unordered_map<int, PerDevice> devices_;
};

}  // namespace mori::io::p2p
