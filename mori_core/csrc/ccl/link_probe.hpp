// The SM link probe: what NVLink moves when SM kernels (not copy engines) drive it, in the
// access patterns the EP kernels use. `bench ccl --ceilings` prints it beside the copy
// engines' ceilings, so "the kernel is at the link" is a measurement of SM traffic.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/gpu_runtime.hpp"

namespace mori::ccl {

enum class LinkProbeMode : int {
  // Each warp loads a 4 KiB piece of `src` once (16-byte loads, 8 in flight per lane) and
  // stores it to every target: the dispatch kernel's pattern.
  kPushAll = 0,
  // (target, piece) items spread over the warps; each stores one piece to one target.
  kPushEach = 1,
  // The bulk-copy engine of sm_90 (TMA): a warp's lane 0 loads a `chunk`-byte piece into
  // shared memory (two stages per warp) and stores it to every target with
  // cp.async.bulk; no registers carry the bytes.
  kPushTma = 2,
  // Remote reads: each warp loads a piece of one target (16-byte loads, 8 in flight per lane)
  // and stores it to local_dst + target_index * bytes: the pull combine's pattern.
  kPull = 3,
};

inline constexpr int kLinkProbeMaxTargets = 8;

struct LinkProbeArgs {
  LinkProbeMode mode = LinkProbeMode::kPushAll;
  uintptr_t src = 0;                 // push: bytes to send (local)
  std::vector<uintptr_t> targets;    // push: where each target receives; pull: what is read there
  uintptr_t local_dst = 0;           // pull: targets.size() * bytes of local memory
  uint64_t bytes = 0;                // per target
  int blocks = 0;
  int warps = 0;                     // per block
  int chunk = 4096;                  // kPushTma: bytes per shared-memory stage
};

#if MORI_WITH_GPU
// "" when `a` can run on `device`, else what is wrong (names the argument and its limit).
std::string LinkProbeProblem(const LinkProbeArgs& a, int device);

// Enqueues one probe kernel on `stream` (throws InvalidArgument for bad arguments, or when
// kPushTma is asked for on a build or device without sm_90 bulk copies).
void LaunchLinkProbe(const LinkProbeArgs& a, gpuStream_t stream);
#endif

}  // namespace mori::ccl
