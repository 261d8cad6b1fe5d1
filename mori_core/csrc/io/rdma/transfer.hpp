// Book-keeping of one RDMA transfer split into chains (and notifications).
//
// `remaining` counts the parts that still owe a completion. The status turns
// terminal only when every part resolved — posted chains by their completion
// (or flush), unposted ones by the poster — so a caller that sees Failed may
// free its buffer: the NIC no longer touches it.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "io/common.hpp"
#include "io/memory_table.hpp"

namespace mori::io::rdma {

struct RdmaTransfer {
  StatusPtr status;
  RegionPin localPin;                // keeps the local region registered until the end
  std::shared_ptr<void> keepAlive;   // QP group + memory regions the WRs reference
  std::atomic<uint32_t> remaining{0};

  void PartDone(StatusCode code, const std::string& message) {
    if (IsError(code)) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!IsError(firstError_)) {
        firstError_ = code;
        firstMessage_ = message;
      }
    }
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      StatusCode c;
      std::string m;
      {
        std::lock_guard<std::mutex> lock(mu_);
        c = firstError_;
        m = firstMessage_;
      }
      localPin = RegionPin();
      keepAlive.reset();
      status->Update(c, m);
    }
  }

 private:
  std::mutex mu_;
  StatusCode firstError_ = StatusCode::SUCCESS;
  std::string firstMessage_;
};

using TransferPtr = std::shared_ptr<RdmaTransfer>;

}  // namespace mori::io::rdma
