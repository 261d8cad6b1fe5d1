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
#include "io/multipart_transfer.hpp"

namespace mori::io::rdma {

struct RdmaTransfer : MultiPartTransfer {
  std::shared_ptr<void> keepAlive;  // QP group + memory regions the WRs reference

 protected:
  void ReleaseResources() override { keepAlive.reset(); }
};

using TransferPtr = std::shared_ptr<RdmaTransfer>;

}  // namespace mori::io::rdma
