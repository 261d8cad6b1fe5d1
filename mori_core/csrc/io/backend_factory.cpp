#include "io/backend_factory.hpp"

#include "common/error.hpp"
#include "io/rdma/rdma_backend.hpp"
#include "io/tcp/tcp_backend.hpp"
#if MORI_WITH_GPU
#include "io/p2p/xgmi_backend.hpp"
#endif

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
    case BackendType::XGMI: {
      auto c = ConfigOrDefault<XgmiBackendConfig>(config, "XgmiBackendConfig");
#if MORI_WITH_GPU
      return std::make_unique<p2p::XgmiBackend>(ctx, c);
#else
      throw BadState("the XGMI (intra-node GPU) backend needs a CUDA/HIP build of mori_core (this build is CPU-only)");
#endif
    }
    case BackendType::RDMA:
      return std::make_unique<rdma::RdmaBackend>(ctx, ConfigOrDefault<RdmaBackendConfig>(config, "RdmaBackendConfig"));
    default:
      throw InvalidArgument(std::string("create_backend: backend type ") + ToString(type) + " is not supported");
  }
}

}  // namespace mori::io
