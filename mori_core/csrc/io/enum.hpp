// Enumerations of MORI-IO. Names and numeric values match AMD's MORI so that
// code (and packed descriptors' meaning) carries over unchanged.
#pragma once

#include <cstdint>

namespace mori::io {

enum class BackendType : uint32_t { Unknown = 0, XGMI = 1, RDMA = 2, TCP = 3, FABRIC = 4 };

enum class MemoryLocationType : uint32_t { Unknown = 0, CPU = 1, GPU = 2 };

enum class StatusCode : uint32_t {
  SUCCESS = 0,
  INIT = 1,
  IN_PROGRESS = 2,
  ERR_BEGIN = 10,  // codes above this are errors
  ERR_INVALID_ARGS = 11,
  ERR_NOT_FOUND = 12,
  ERR_RDMA_OP = 13,
  ERR_BAD_STATE = 14,
  ERR_GPU_OP = 15,
};

enum class PollCqMode : uint32_t { POLLING = 0, EVENT = 1 };

inline bool IsError(StatusCode c) { return static_cast<uint32_t>(c) > static_cast<uint32_t>(StatusCode::ERR_BEGIN); }
inline bool IsTerminal(StatusCode c) { return c == StatusCode::SUCCESS || IsError(c); }

const char* ToString(BackendType t);
const char* ToString(MemoryLocationType t);
const char* ToString(StatusCode c);

}  // namespace mori::io
