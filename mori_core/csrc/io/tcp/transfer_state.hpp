// Book-keeping of one TCP transfer split into frames.
//
// The status becomes terminal only when every frame has resolved (acked,
// refused or failed with its connection): a caller that sees Failed can free
// its buffer, because no socket thread still reads from or writes into it.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "io/common.hpp"
#include "io/multipart_transfer.hpp"
#include "io/segments.hpp"
#include "io/tcp/wire.hpp"

#include <sys/uio.h>
#include <vector>

namespace mori::io::tcp {

struct TcpTransfer : MultiPartTransfer {
  uint8_t* localBase = nullptr;
  MemoryLocationType localLoc = MemoryLocationType::CPU;
  int localDevice = -1;
};

// One request on the wire; `segments` hold local and remote offsets.
struct Frame {
  std::shared_ptr<TcpTransfer> xfer;
  bool isRead = false;
  uint32_t remoteMemId = 0;
  TransferUniqueId uid = 0;
  uint32_t notifyTotal = 0;  // 0 = no notification
  SegmentList segments;
  uint64_t bytes = 0;
  uint64_t requestId = 0;  // set by the connection
  // Wire image, built once by the connection; iovIdx tracks a partial send
  // so the sender thread can finish a frame the caller started.
  RequestHeader header{};
  std::vector<WireSegment> table;
  std::vector<struct iovec> iov;
  size_t iovIdx = 0;
  // Guarded by the owning connection's mutex: a frame whose bytes a socket
  // thread is moving right now is resolved by that thread, never under it.
  int busy = 0;
  bool resolved = false;
  // The reply, once received; applied by whichever thread drops busy to 0.
  bool hasOutcome = false;
  StatusCode outcome = StatusCode::SUCCESS;
  std::string outcomeMessage;
};
using FramePtr = std::shared_ptr<Frame>;

}  // namespace mori::io::tcp
