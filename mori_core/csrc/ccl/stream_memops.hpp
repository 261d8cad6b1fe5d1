// Stream memory operations: a stream waits until a 32-bit word holds a value, or writes
// one, executed by the GPU's front end with no kernel. The copy-engine collectives
// synchronise with them, so moving and waiting take no SM. Usable inside CUDA graph capture.
#pragma once

#include <cstdint>
#include <string>

#include "common/gpu_runtime.hpp"

#if MORI_WITH_GPU
namespace mori::ccl {

struct MemOp {
  bool wait;       // true: wait until *addr == value; false: *addr = value (after the stream's prior writes)
  uint64_t addr;   // device address: this GPU's memory, a peer's IPC-mapped memory, or mapped host memory
  uint32_t value;
};

// "" when this build and driver have the operations, else why not.
const std::string& StreamMemOpsUnavailable();

// Enqueues `ops` in order on `stream`: one batched call when `batch`, else one call each.
void SubmitMemOps(gpuStream_t stream, const MemOp* ops, int count, bool batch);

}  // namespace mori::ccl
#endif
