// One kernel launch that copies a batch of many scattered segments between
// GPU-accessible pointers (local and peer memory mapped over NVLink). For a
// few large segments the copy engines are better; XgmiBackend decides.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/gpu_runtime.hpp"

namespace mori::io::p2p {

struct CopySeg {
  uint64_t src;
  uint64_t dst;
  uint64_t size;
};

// Large segments are cut into pieces of this size so that every SM gets work.
constexpr uint64_t kScatterPieceBytes = 16 << 10;

// Enqueues copies of `segs` on `stream` (device current). Throws GpuError.
void LaunchScatterCopy(const CopySeg* segs, size_t count, gpuStream_t stream);

}  // namespace mori::io::p2p
