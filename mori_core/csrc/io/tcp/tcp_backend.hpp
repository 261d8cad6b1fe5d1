// BackendType.TCP: a one-sided data plane over plain sockets, for any pair of
// hosts and for CPU or GPU memory (GPU memory is staged through pinned host
// buffers). The engine's default when nothing faster applies.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "io/backend.hpp"
#include "io/engine_context.hpp"
#include "io/tcp/peer_link.hpp"

namespace mori::io::tcp {

class TcpBackend : public Backend {
 public:
  TcpBackend(EngineContext& ctx, const TcpBackendConfig& config);
  ~TcpBackend() override;

  BackendType Type() const override { return BackendType::TCP; }
  void RegisterRemoteEngine(const EngineDesc& desc) override;
  void DeregisterRemoteEngine(const EngineDesc& desc) override;
  bool CanHandle(const MemoryDesc& local, const MemoryDesc& remote) const override;
  void Submit(TransferRequest req) override;
  std::unique_ptr<BackendSession> CreateSession(const MemoryDesc& local, const MemoryDesc& remote) override;

  const TcpBackendConfig& config() const { return config_; }
  // Returns the link to a registered remote engine (created on first use).
  std::shared_ptr<PeerLink> LinkFor(const std::string& remoteKey, std::string* err);
  static std::shared_ptr<TcpTransfer> NewTransfer(const MemoryDesc& local, RegionPin pin, StatusPtr status);

 private:
  EngineContext& ctx_;
  TcpBackendConfig config_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<PeerLink>> links_;
};

}  // namespace mori::io::tcp
