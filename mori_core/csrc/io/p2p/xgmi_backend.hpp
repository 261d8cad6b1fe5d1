// BackendType.XGMI — intra-node GPU transfers. On NVIDIA this is CUDA IPC
// over NVLink/PCIe (the name is MORI's, from AMD's XGMI links).
//
// The initiator maps the peer's registered GPU memory into its own address
// space (ipc_cache) and moves the bytes itself: copy engines for few large
// segments, one scatter-copy kernel for batches of many small ones. A batch
// call over many region pairs (per-layer K and V buffers) is moved by one
// launch per initiating GPU, not one per pair. Nothing runs on the target;
// when it wants to know, a notification follows the data over the control
// plane (notify_channel).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <vector>
#include <unordered_map>

#include "io/backend.hpp"
#include "io/engine_context.hpp"
#include "io/notify_channel.hpp"
#include "io/p2p/completion_waiter.hpp"
#include "io/p2p/scatter_copy.hpp"
#include "io/p2p/stream_pool.hpp"

namespace mori::io::p2p {

// Which engine copies a GPU<->GPU transfer, and the scatter kernel's shape.
// Environment overrides (read when the backend is created):
// MORI_IO_XGMI_KERNEL_MIN_SEGMENTS, MORI_IO_XGMI_KERNEL_MAX_AVG_BYTES,
// MORI_IO_XGMI_PIECE_BYTES, MORI_IO_XGMI_BLOCK_THREADS, MORI_IO_XGMI_MAX_BLOCKS,
// MORI_IO_XGMI_READ_PIECE_BYTES.
struct XgmiTuning {
  int kernelMinSegments = 1;             // fewer segments: copy engines
  uint64_t kernelMaxAvgBytes = 4 << 20;  // larger average segment: copy engines
  bool copyEngineBatch = true;           // copy engines: one cudaMemcpyBatchAsync per launch (CUDA >= 13)
  ScatterShape shape;
  // Pieces of a large read (a segment table, >= kLargeReadBytes). A read pulls over NVLink and
  // each block pays a binary search over the table before its first load; fewer, larger pieces
  // measured faster there (vLLM READ of 4,096 x 64 KiB on 4xH100: 0.84-0.94 ms with 64 KiB
  // pieces against 0.95-1.10 ms with 16 KiB), while writes did not move.
  uint32_t largeReadPieceBytes = 64 << 10;
  static constexpr uint64_t kLargeReadBytes = 32ull << 20;
  static XgmiTuning FromEnv();  // throws InvalidArgument naming the variable and its limit
};

class XgmiBackend : public Backend {
 public:
  XgmiBackend(EngineContext& ctx, const XgmiBackendConfig& config);
  ~XgmiBackend() override;

  BackendType Type() const override { return BackendType::XGMI; }
  void RegisterRemoteEngine(const EngineDesc& desc) override;
  void DeregisterRemoteEngine(const EngineDesc& desc) override;
  void RegisterMemory(MemoryDesc& desc) override;
  void DeregisterMemory(const MemoryDesc& desc) override;
  bool CanHandle(const MemoryDesc& local, const MemoryDesc& remote) const override;
  void Submit(TransferRequest req) override;
  void SubmitBatch(std::vector<TransferRequest>& reqs) override;
  std::unique_ptr<BackendSession> CreateSession(const MemoryDesc& local, const MemoryDesc& remote) override;

  // Both ends of a pair as this process sees them.
  struct Route {
    uint8_t* localPtr = nullptr;
    uint8_t* remotePtr = nullptr;
    int device = -1;         // device whose stream does the copy
    bool kernelOk = false;   // both ends are device memory
    std::shared_ptr<const EngineDesc> target;
    StreamPool::Device* resources = nullptr;  // the device's streams, slots, tables (set once resolved)
  };
  bool Resolve(const MemoryDesc& local, const MemoryDesc& remote, Route* route, StatusCode* code, std::string* err);
  // Resolve through a cache keyed by (local id, remote engine, remote id):
  // mapping lookups, peer checks and descriptor copies happen once per pair,
  // not per transfer. A hit counts only when the remote descriptor is the
  // cached one, IPC handle and offset included (a forged or stale descriptor
  // under a known id is resolved, and checked, again). Entries go with the
  // local region, or with the remote engine (deregistered or registered again).
  bool CachedResolve(const MemoryDesc& local, const MemoryDesc& remote, Route* route, StatusCode* code,
                     std::string* err);
  // Caller has route.device current.
  StreamPool::Device& Resources(const Route& route) {
    return route.resources ? *route.resources : pool_->ForDevice(route.device);
  }
  // One transfer whose route is resolved.
  struct Job {
    const Route* route;
    const SegmentList* segs;
    TransferUniqueId uid;
    StatusPtr status;
    RegionPin pin;
  };
  // Moves `jobs` together (same direction; GPU<->GPU jobs initiated on
  // route.device of the first): one kernel launch, the copy proxy, or
  // copy-engine copies behind one event; every job's status ends with it.
  // Jobs touching CPU memory must come alone.
  void Launch(std::vector<Job>& jobs, bool isRead);
  // The scatter kernel (true) or copy engines (false) for `segments` segments
  // of `totalBytes` in all.
  bool UseKernel(size_t segments, uint64_t totalBytes) const;

 private:
  int LocalOrdinal(const std::string& busId) const;
  bool PeerCapable(int a, int b) const;
  void EnablePeer(int a, int b);
  // Enqueues copy-engine copies on `stream`: one cudaMemcpyBatchAsync where the runtime
  // has it, else (or once it refused a batch) one cudaMemcpyAsync per copy. True: batched.
  bool EnqueueCopyEngines(const std::vector<void*>& dsts, const std::vector<const void*>& srcs,
                          const std::vector<size_t>& sizes, gpuStream_t stream);

  EngineContext& ctx_;
  XgmiBackendConfig config_;
  XgmiTuning tuning_;
  std::shared_ptr<StreamPool> pool_;
  std::unique_ptr<NotificationSender> notifier_;
  std::unique_ptr<CompletionWaiter> waiter_;
  struct RouteKey {
    MemoryUniqueId local;
    MemoryUniqueId remote;
    std::string engine;
    bool operator==(const RouteKey& o) const { return local == o.local && remote == o.remote && engine == o.engine; }
  };
  struct RouteKeyHash {
    size_t operator()(const RouteKey& k) const {
      return std::hash<std::string>()(k.engine) ^ (static_cast<size_t>(k.local) << 32 | k.remote);
    }
  };
  struct CachedRoute {
    Route route;
    MemoryDesc remote;  // the descriptor it was resolved from
  };
  std::shared_mutex routesMu_;
  std::unordered_map<RouteKey, CachedRoute, RouteKeyHash> routes_;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, int> ordinals_;
  mutable std::map<std::pair<int, int>, bool> peerCapable_;
  std::set<std::pair<int, int>> peerEnabled_;
  std::atomic<bool> copyBatchOk_{true};  // false once the runtime refused cudaMemcpyBatchAsync
};

}  // namespace mori::io::p2p
