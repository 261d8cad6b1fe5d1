// BackendType.XGMI — intra-node GPU transfers. On NVIDIA this is CUDA IPC
// over NVLink/PCIe (the name is MORI's, from AMD's XGMI links).
//
// The initiator maps the peer's registered GPU memory into its own address
// space (ipc_cache) and moves the bytes itself: copy engines for few large
// segments, one scatter-copy kernel for batches of many small ones. Nothing
// runs on the target; when it wants to know, a notification follows the data
// over the control plane (notify_channel).
#pragma once

#include <memory>
#include <mutex>
#include <set>
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
// MORI_IO_XGMI_PIECE_BYTES, MORI_IO_XGMI_BLOCK_THREADS.
struct XgmiTuning {
  int kernelMinSegments = 1;             // fewer segments: copy engines
  uint64_t kernelMaxAvgBytes = 4 << 20;  // larger average segment: copy engines
  ScatterShape shape;
  static XgmiTuning FromEnv();  // throws InvalidArgument naming the variable and its limit
};

class XgmiBackend : public Backend {
 public:
  XgmiBackend(EngineContext& ctx, const XgmiBackendConfig& config);
  ~XgmiBackend() override;

  BackendType Type() const override { return BackendType::XGMI; }
  void DeregisterRemoteEngine(const EngineDesc& desc) override;
  void RegisterMemory(MemoryDesc& desc) override;
  bool CanHandle(const MemoryDesc& local, const MemoryDesc& remote) const override;
  void Submit(TransferRequest req) override;
  std::unique_ptr<BackendSession> CreateSession(const MemoryDesc& local, const MemoryDesc& remote) override;

  // Both ends of a pair as this process sees them.
  struct Route {
    uint8_t* localPtr = nullptr;
    uint8_t* remotePtr = nullptr;
    int device = -1;         // device whose stream does the copy
    bool kernelOk = false;   // both ends are device memory
    std::shared_ptr<const EngineDesc> target;
    StreamPool::Device* resources = nullptr;  // cached by sessions; looked up per call otherwise
  };
  bool Resolve(const MemoryDesc& local, const MemoryDesc& remote, Route* route, StatusCode* code, std::string* err);
  // Caller has route.device current.
  StreamPool::Device& Resources(const Route& route) {
    return route.resources ? *route.resources : pool_->ForDevice(route.device);
  }
  void Launch(const Route& route, const SegmentList& segs, bool isRead, TransferUniqueId uid, const StatusPtr& status,
              RegionPin pin);
  // The scatter kernel (true) or copy engines (false) for this transfer.
  bool UseKernel(const Route& route, const SegmentList& segs, uint64_t totalBytes) const;

 private:
  int LocalOrdinal(const std::string& busId) const;
  bool PeerCapable(int a, int b) const;
  void EnablePeer(int a, int b);

  EngineContext& ctx_;
  XgmiBackendConfig config_;
  XgmiTuning tuning_;
  std::shared_ptr<StreamPool> pool_;
  std::unique_ptr<NotificationSender> notifier_;
  std::unique_ptr<CompletionWaiter> waiter_;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, int> ordinals_;
  mutable std::map<std::pair<int, int>, bool> peerCapable_;
  std::set<std::pair<int, int>> peerEnabled_;
};

}  // namespace mori::io::p2p
