// IOEngine: the MORI-IO transfer engine.
//
// Owns the backends, the registry of local memory, the known remote engines
// and the route cache that maps a (remote engine, local region, remote region)
// to the backend that serves it. Transfers never throw for transfer-level
// problems: they return a TransferStatus that ends in SUCCESS or an ERR_* code.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <vector>

#include "io/backend.hpp"
#include "io/engine_context.hpp"

namespace mori::io {

class IOEngine;

// A pre-resolved (local region, remote region, backend) binding: the hot path
// skips route lookups entirely.
class IOEngineSession {
 public:
  IOEngineSession(IOEngine& engine, std::unique_ptr<BackendSession> session, MemoryDesc local, MemoryDesc remote);

  TransferUniqueId AllocateTransferUniqueId();
  StatusPtr Read(uint64_t localOffset, uint64_t remoteOffset, uint64_t size, TransferUniqueId uid);
  StatusPtr Write(uint64_t localOffset, uint64_t remoteOffset, uint64_t size, TransferUniqueId uid);
  StatusPtr BatchReadWrite(const std::vector<uint64_t>& localOffsets, const std::vector<uint64_t>& remoteOffsets,
                           const std::vector<uint64_t>& sizes, TransferUniqueId uid, bool isRead);
  bool Alive() const;
  const MemoryDesc& local() const { return local_; }
  const MemoryDesc& remote() const { return remote_; }

 private:
  StatusPtr Submit(SegmentList segs, TransferUniqueId uid, bool isRead);
  IOEngine& engine_;
  std::unique_ptr<BackendSession> session_;
  MemoryDesc local_, remote_;
};

class IOEngine {
 public:
  IOEngine(const std::string& key, const IOEngineConfig& config);
  ~IOEngine();
  IOEngine(const IOEngine&) = delete;
  IOEngine& operator=(const IOEngine&) = delete;

  EngineDesc GetEngineDesc() const { return ctx_.Desc(); }
  const std::string& key() const { return ctx_.key; }

  void CreateBackend(BackendType type, const BackendConfig* config);
  void RemoveBackend(BackendType type);
  bool HasBackend(BackendType type) const;
  std::vector<BackendType> Backends() const;

  void RegisterRemoteEngine(const EngineDesc& desc);
  void DeregisterRemoteEngine(const EngineDesc& desc);

  MemoryDesc RegisterMemory(uint64_t ptr, uint64_t size, int deviceId, MemoryLocationType loc);
  void DeregisterMemory(const MemoryDesc& desc);

  TransferUniqueId AllocateTransferUniqueId() { return nextUid_.fetch_add(1); }

  StatusPtr Read(const MemoryDesc& local, uint64_t localOffset, const MemoryDesc& remote, uint64_t remoteOffset,
                 uint64_t size, TransferUniqueId uid);
  StatusPtr Write(const MemoryDesc& local, uint64_t localOffset, const MemoryDesc& remote, uint64_t remoteOffset,
                  uint64_t size, TransferUniqueId uid);
  // One status per (local, remote) pair. Throws InvalidArgument when the
  // outer lists differ in length; per-pair problems end that pair's status.
  std::vector<StatusPtr> BatchReadWrite(const std::vector<const MemoryDesc*>& locals,
                                        const std::vector<std::vector<uint64_t>>& localOffsets,
                                        const std::vector<const MemoryDesc*>& remotes,
                                        const std::vector<std::vector<uint64_t>>& remoteOffsets,
                                        const std::vector<std::vector<uint64_t>>& sizes,
                                        const std::vector<TransferUniqueId>& uids, bool isRead);

  // nullptr when no backend can serve the pair (reason in *why when given).
  std::unique_ptr<IOEngineSession> CreateSession(const MemoryDesc& local, const MemoryDesc& remote,
                                                 std::string* why = nullptr);
  bool PopInboundTransferStatus(const std::string& remoteKey, TransferUniqueId uid);

  // Which backend would serve the pair; Unknown when none (reason in *why).
  BackendType RouteOf(const MemoryDesc& local, const MemoryDesc& remote, std::string* why);

  EngineContext& context() { return ctx_; }

 private:
  friend class IOEngineSession;
  struct Route {
    Backend* backend = nullptr;
    std::shared_ptr<LocalRegion> region;  // the local region, looked up once
    StatusCode code = StatusCode::SUCCESS;
    std::string error;
  };
  // Caller holds backendsMu_ (shared).
  Route Resolve(const MemoryDesc& local, const MemoryDesc& remote);
  StatusPtr Submit(const MemoryDesc& local, const MemoryDesc& remote, SegmentList segs, TransferUniqueId uid,
                   bool isRead);
  // Caller holds backendsMu_ (shared). Resolves, pins, checks and merges one
  // transfer. Returns its status; when a backend has work to do, *backend and
  // *req are set (status IN_PROGRESS), else the status is already final.
  StatusPtr Prepare(const MemoryDesc& local, const MemoryDesc& remote, SegmentList segs, TransferUniqueId uid,
                    bool isRead, Backend** backend, TransferRequest* req);
  void InvalidateRoutes();
  static StatusPtr Finished(StatusCode code, const std::string& message);
  bool AutoXgmiWanted() const;

  EngineContext ctx_;
  std::atomic<TransferUniqueId> nextUid_{1};

  mutable std::shared_mutex backendsMu_;
  std::map<BackendType, std::unique_ptr<Backend>> backends_;

  using RouteKey = std::tuple<std::string, MemoryUniqueId, MemoryUniqueId>;
  mutable std::shared_mutex routesMu_;
  std::map<RouteKey, Backend*, std::less<>> routes_;  // transparent: found without copying the key's string
};

}  // namespace mori::io
