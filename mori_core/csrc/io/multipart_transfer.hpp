// A transfer that a backend splits into parts (TCP frames, RDMA work-request
// chains and notifications). `remaining` counts the parts that still owe an
// outcome; the first error wins; the status turns terminal only when every
// part resolved, after the resources the parts used were released — so a
// caller that sees Failed may free its buffer: nothing of ours touches it.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "io/common.hpp"
#include "io/memory_table.hpp"

namespace mori::io {

class MultiPartTransfer {
 public:
  virtual ~MultiPartTransfer() = default;

  StatusPtr status;
  RegionPin localPin;  // keeps the local region registered until the end
  std::atomic<uint32_t> remaining{0};

  void PartDone(StatusCode code, const std::string& message) {
    if (IsError(code)) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!IsError(firstError_)) {
        firstError_ = code;
        firstMessage_ = message;
      }
    }
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    StatusCode c;
    std::string m;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c = firstError_;
      m = firstMessage_;
    }
    localPin = RegionPin();
    ReleaseResources();
    status->Update(c, m);
  }

 protected:
  // Backend-specific resources the parts referenced (released before the status ends).
  virtual void ReleaseResources() {}

 private:
  std::mutex mu_;
  StatusCode firstError_ = StatusCode::SUCCESS;
  std::string firstMessage_;
};

}  // namespace mori::io
