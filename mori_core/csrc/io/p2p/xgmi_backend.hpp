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
#include "io/p2p/stream_pool.hpp"

namespace mori::io::p2p {

struct XgmiTuning {
  int kernelMinSegments = 4;            // fewer segments: copy engines
  uint64_t kernelMaxAvgBytes = 4 << 20; // larger average segment: copy engines
  static XgmiTuning FromEnv();
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
    EngineDesc target;
  };
  bool Resolve(const MemoryDesc& local, const MemoryDesc& remote, Route* route, StatusCode* code, std::string* err);
  void Launch(const Route& route, const SegmentList& segs, bool isRead, TransferUniqueId uid, const StatusPtr& status,
              RegionPin pin);

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
