// Timestamps of the last submission made on this thread, so a benchmark can
// name where the fixed per-transfer cost goes (argument conversion,
// validation, the GPU launch, bookkeeping) instead of guessing.
//
// Off by default: every mark is then one relaxed atomic load. The clock is
// CLOCK_MONOTONIC, the clock of Python's time.perf_counter_ns() on Linux, so
// the caller can put its own timestamps before and after the call beside these.
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>

namespace mori::io::profile {

enum Stamp : int {
  kEnter = 0,    // the binding was entered (Python arguments not yet read)
  kConverted,    // offsets/sizes read into C++ (GIL released after this)
  kValidated,    // bounds checked, segments merged, status created
  kLaunchBegin,  // backend: right before the first GPU API call of the copy
  kLaunchEnd,    // backend: right after the last one
  kSubmitted,    // the engine returned the status
  kStampCount
};

const char* StampName(Stamp s);

// How a GPU backend moved the bytes (so a benchmark or test can tell which
// engine served a transfer without timing it).
enum Path : int { kPathNone = 0, kPathKernel, kPathCopyEngines, kPathProxy, kPathCopyEngineBatch };
const char* PathName(Path p);

extern std::atomic<bool> gEnabled;

struct Stamps {
  int64_t ns[kStampCount] = {};
  Path path = kPathNone;
};

// This thread's stamps of its last submission.
Stamps& ThreadStamps();

inline int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

inline void Mark(Stamp s) {
  if (gEnabled.load(std::memory_order_relaxed)) ThreadStamps().ns[s] = NowNs();
}

inline void SetPath(Path p) {
  if (gEnabled.load(std::memory_order_relaxed)) ThreadStamps().path = p;
}

// Clears this thread's stamps and marks kEnter (start of a new submission).
inline void Begin() {
  if (!gEnabled.load(std::memory_order_relaxed)) return;
  Stamps& st = ThreadStamps();
  st = Stamps{};
  st.ns[kEnter] = NowNs();
}

}  // namespace mori::io::profile
