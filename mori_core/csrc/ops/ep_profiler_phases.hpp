// Phases the EP kernel profiler records (MORI_ENABLE_PROFILER builds). Plain C++ so the
// bindings can publish the names (build_info()["ep_profiler_phases"]) to the Perfetto
// exporter in every build: the id of a phase is its index in kEpProfilerPhaseNames.
#pragma once

#include <cstdint>

namespace mori::ep {

enum EpProfPhase : int32_t {
  kProfDispatchRoute = 0,   // dispatch: destination masks, slot reservation, slots
  kProfDispatchCopy = 1,    // dispatch: rows (and weights, ids, scales) stored to the destinations
  kProfDispatchSignal = 2,  // dispatch, block 0: wait until every source's blocks have arrived
  kProfStdPlan = 3,         // standard-MoE plan: token ranks per expert, counts published (fused: the
                            // dispatch blocks' count of the tokens before theirs)
  kProfStdExpand = 4,       // standard-MoE dispatch: received rows copied into the 3-D layout
  kProfCombineStage = 5,    // combine phase 0: rows pushed to their sources (or quantised / staged)
  kProfCombineBarrier = 6,  // combine: signal the round, wait for every peer
  kProfCombineReduce = 7,   // combine phase 1: sum of each token's rows
  kProfConvertDispatch = 8, // convert_dispatch_output: rows copied into the 3-D layout
  kProfConvertCombine = 9,  // convert_combine_input: weighted sum of each token's expert rows
  // Inside dispatch_route of the standard-MoE dispatch that ranks its own tokens:
  kProfStdBits = 10,        // destination masks and the tokens' bits in the per-expert bitmaps
  kProfStdRank = 11,        // each (token, expert)'s position among the rank's rows of the expert
  kProfStdCount = 12,       // the round's tokens added to the per-expert counts
  // Inside std_expand:
  kProfStdExpandBase = 13,  // the sources' counts read, each local expert's per-source bases set
  kProfStdExpandFirst = 14, // a warp's first item: its rows' slices, ids and positions loaded, its
                            // first pass stored
  kProfStdExpandItems = 15, // all of a warp's items: rows stored to their layout slots
  kProfNumPhases = 16,
};

inline constexpr const char* kEpProfilerPhaseNames[kProfNumPhases] = {
    "dispatch_route", "dispatch_copy", "dispatch_signal", "std_plan",       "std_expand",
    "combine_stage",  "combine_barrier", "combine_reduce", "convert_dispatch", "convert_combine",
    "std_bits",       "std_rank",        "std_count",       "std_expand_base", "std_expand_first",
    "std_expand_items",
};

// Device buffer: kProfMaxWarps warp slots (slot = block * warps_per_block + warp of one
// launch) x kProfEventsPerWarp events x {globaltimer ns, meta}; a per-slot cursor counts
// the events written (events past the capacity are dropped, the cursor keeps counting).
constexpr int kProfMaxWarps = 8192;
constexpr int kProfEventsPerWarp = 128;

// meta = kind | phase << 2 | warp << 8 | block << 16 | round << 32
//   kind: 0 begin, 1 end; warp: warp index in its block; round: the op's dispatch or
//   combine round number (tells calls apart).
constexpr int kProfKindBegin = 0;
constexpr int kProfKindEnd = 1;

}  // namespace mori::ep
