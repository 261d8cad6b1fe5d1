// Per-warp phase timestamps of the EP kernels (%globaltimer / s_memrealtime, in ns).
// MORI_PROF_BEGIN/END compile to nothing unless the build sets MORI_ENABLE_PROFILER
// (CMake -DMORI_ENABLE_PROFILER=ON): zero cost in normal builds.
#pragma once

#include "ops/device_primitives.hpp"
#include "ops/ep_profiler_phases.hpp"
#include "ops/ep_types.hpp"

#if MORI_ENABLE_PROFILER
namespace mori::ep::dev {

// Lane 0 of the calling warp appends one event to its warp slot.
__device__ __forceinline__ void ProfRecord(const EpKernelArgs& a, int phase, int kind, uint32_t round) {
  if (LaneId() != 0) return;
  const int nwarps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize;
  const int slot = blockIdx.x * nwarps + warp;
  if (slot >= kProfMaxWarps) return;
  const int idx = a.buf.prof_cursor[slot]++;  // one warp per slot per launch; launches are stream-ordered
  if (idx >= kProfEventsPerWarp) return;
  int64_t* e = a.buf.prof_events + (static_cast<int64_t>(slot) * kProfEventsPerWarp + idx) * 2;
  const uint64_t meta = static_cast<uint64_t>(kind) | (static_cast<uint64_t>(phase) << 2) |
                        (static_cast<uint64_t>(warp) << 8) | (static_cast<uint64_t>(blockIdx.x & 0xffff) << 16) |
                        (static_cast<uint64_t>(round) << 32);
  e[0] = static_cast<int64_t>(GlobalTimerNs());
  e[1] = static_cast<int64_t>(meta);
}

}  // namespace mori::ep::dev
#define MORI_PROF_BEGIN(args, phase, round) ::mori::ep::dev::ProfRecord((args), (phase), ::mori::ep::kProfKindBegin, (round))
#define MORI_PROF_END(args, phase, round) ::mori::ep::dev::ProfRecord((args), (phase), ::mori::ep::kProfKindEnd, (round))
#else
#define MORI_PROF_BEGIN(args, phase, round) \
  do {                                      \
    (void)(round);                          \
  } while (0)
#define MORI_PROF_END(args, phase, round) \
  do {                                    \
    (void)(round);                        \
  } while (0)
#endif
