// Construction of backends by type: the single place that knows which
// transports this build carries.
#pragma once

#include <memory>

#include "io/backend.hpp"
#include "io/engine_context.hpp"

namespace mori::io {

// Throws InvalidArgument for a config of the wrong type and BadState when the
// backend is unavailable in this build or on this machine (with the reason).
std::unique_ptr<Backend> MakeBackend(BackendType type, EngineContext& ctx, const BackendConfig* config);

}  // namespace mori::io
