// The one interface every transport implements (TCP, XGMI/P2P, RDMA).
//
// A backend moves bytes between a local and a remote registered region. The
// engine has already resolved both descriptors, checked bounds against them
// and merged contiguous segments; the backend owns everything after that:
// submission, completion (it must end `status` in bounded time, also when the
// peer dies) and, on the target, counting inbound parts for notifications.
#pragma once

#include <memory>
#include <vector>

#include "io/common.hpp"
#include "io/memory_table.hpp"
#include "io/segments.hpp"

namespace mori::io {

struct EngineContext;

// One transfer as the engine hands it to a backend.
struct TransferRequest {
  const MemoryDesc* local;
  const MemoryDesc* remote;
  SegmentList segments;  // validated and merged
  TransferUniqueId uid;
  bool isRead;
  StatusPtr status;      // already IN_PROGRESS
  RegionPin localPin;    // keeps the local region registered; release when done
};

class BackendSession {
 public:
  virtual ~BackendSession() = default;
  // Same contract as Backend::Submit for the session's fixed pair of regions.
  virtual void Submit(SegmentList segments, TransferUniqueId uid, bool isRead, const StatusPtr& status) = 0;
  virtual bool Alive() const = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendType Type() const = 0;

  virtual void RegisterRemoteEngine(const EngineDesc&) {}
  virtual void DeregisterRemoteEngine(const EngineDesc&) {}
  // May fill backend-specific fields of the descriptor (e.g. IPC handle).
  virtual void RegisterMemory(MemoryDesc&) {}
  virtual void DeregisterMemory(const MemoryDesc&) {}

  // Whether this backend can move data between the two regions.
  virtual bool CanHandle(const MemoryDesc& local, const MemoryDesc& remote) const = 0;
  virtual void Submit(TransferRequest req) = 0;
  // Several transfers of one batch call, all routed to this backend, in the
  // caller's order. A backend that can move them together (XGMI: one kernel
  // launch for every GPU pair of a device) overrides it; each request still
  // ends its own status. The default submits them one by one.
  virtual void SubmitBatch(std::vector<TransferRequest>& reqs) {
    for (auto& r : reqs) Submit(std::move(r));
  }
  // nullptr when a session cannot be built (the engine then reports it).
  virtual std::unique_ptr<BackendSession> CreateSession(const MemoryDesc& local, const MemoryDesc& remote) = 0;
};

}  // namespace mori::io
