// One kernel launch that copies a batch of many scattered segments between
// GPU-accessible pointers (local and peer memory mapped over NVLink). For a
// few large segments the copy engines are better; XgmiBackend decides.
//
// Segments travel in the kernel's parameter block (no upload, no buffer to
// track); each block copies one piece of `pieceBytes` and finds its segment by
// a binary search over the segments' first-piece indices, so a batch of 64
// large segments costs the same parameter bytes as 64 small ones. When a
// signal is given, the last block to finish makes every copy visible to the
// whole system and then writes `value` into a host-mapped word: the host
// learns of completion by reading memory instead of querying an event.
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

struct ScatterShape {
  uint32_t pieceBytes = 16 << 10;  // power of two in [4 KiB, 1 MiB]: bytes one block copies
  uint32_t threads = 256;          // threads per block: multiple of 32 in [64, 1024]
};

struct KernelSignal {
  uint32_t* counter = nullptr;  // device memory, 0 before the launch; the last block resets it to 0
  uint32_t* flag = nullptr;     // host-mapped word (device view); nullptr = no signal
  uint32_t value = 0;           // written into *flag when every copy landed
};

// Most segments one launch carries; larger batches take several launches
// (the signal rides on the last one: stream order completes the others first).
size_t MaxSegmentsPerLaunch();

// Enqueues copies of `segs` on `stream` (its device current). Throws GpuError,
// or InvalidArgument for a shape out of range.
void LaunchScatterCopy(const CopySeg* segs, size_t count, const ScatterShape& shape, const KernelSignal& signal,
                       gpuStream_t stream);

}  // namespace mori::io::p2p
