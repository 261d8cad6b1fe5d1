// BackendType.RDMA: one-sided RDMA READ/WRITE over RC queue pairs
// (libibverbs, loaded at run time), GPU memory registered for GPUDirect.
//
// Construction fails with mori::BadState when libibverbs or a usable RDMA
// port is missing, with a message that says which and what to do; the engine
// then simply has no RDMA backend and routes to TCP when that exists.
#pragma once

#include <memory>

#include "io/backend.hpp"
#include "io/engine_context.hpp"

namespace mori::io::rdma {

class RdmaCore;

class RdmaBackend : public Backend {
 public:
  RdmaBackend(EngineContext& ctx, const RdmaBackendConfig& config);
  ~RdmaBackend() override;

  BackendType Type() const override { return BackendType::RDMA; }
  void RegisterRemoteEngine(const EngineDesc& desc) override;
  void DeregisterRemoteEngine(const EngineDesc& desc) override;
  void DeregisterMemory(const MemoryDesc& desc) override;
  bool CanHandle(const MemoryDesc& local, const MemoryDesc& remote) const override;
  void Submit(TransferRequest req) override;
  std::unique_ptr<BackendSession> CreateSession(const MemoryDesc& local, const MemoryDesc& remote) override;

 private:
  EngineContext& ctx_;
  std::shared_ptr<RdmaCore> core_;
};

}  // namespace mori::io::rdma
