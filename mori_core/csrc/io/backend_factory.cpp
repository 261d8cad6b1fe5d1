#include "io/backend_factory.hpp"

#include "common/error.hpp"
#include "io/tcp/tcp_backend.hpp"

namespace mori::io {
namespace {

template <typename Config>
Config ConfigOrDefault(const BackendConfig* config, const char* name) {
  if (!config) return Config{};
  auto* c = dynamic_cast<const Config*>(config);
  if (!c) throw InvalidArgument(std::string("create_backend: config must be a ") + name);
  return *c;
}

}  // namespace

std::unique_ptr<Backend> MakeBackend(BackendType type, EngineContext& ctx, const BackendConfig* config) {
  switch (type) {
    case BackendType::TCP:
      return std::make_unique<tcp::TcpBackend>(ctx, ConfigOrDefault<TcpBackendConfig>(config, "TcpBackendConfig"));
    case BackendType::XGMI:
      (void)ConfigOrDefault<XgmiBackendConfig>(config, "XgmiBackendConfig");
      throw BadState("the XGMI (intra-node GPU) backend is not available in this build");
    case BackendType::RDMA:
      (void)ConfigOrDefault<RdmaBackendConfig>(config, "RdmaBackendConfig");
      throw BadState("the RDMA backend is not available in this build");
    default:
      throw InvalidArgument(std::string("create_backend: backend type ") + ToString(type) + " is not supported");
  }
}

}  // namespace mori::io
