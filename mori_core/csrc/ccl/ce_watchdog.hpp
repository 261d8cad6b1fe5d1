// Bounds the copy-engine collectives' waits. A stream waiting on a peer's flag
// (cuStreamWaitValue32) has no timeout of its own, so every wait site sets a host-mapped
// "busy" word while it waits (a stream write operation before and after the wait, also
// inside CUDA graphs). One process-wide thread samples the words; a site busy for longer
// than its handle's timeout is handed to the handle, which names the peers that did not
// signal and releases the stream (see CclHandle::OnStuck).
#pragma once

#include <cstdint>
#include <vector>

namespace mori::ccl {

class StuckListener {
 public:
  virtual ~StuckListener() = default;
  // Called on the watchdog thread when `site` stayed busy past the timeout. Returns true when
  // it acted (the site's timer restarts either way).
  virtual bool OnStuck(int site) = 0;
};

// `busy`: host-visible words, one per site (non-zero while the stream waits there).
void WatchSites(StuckListener* who, const volatile uint32_t* busy, int sites, double timeout_s);
// Stops watching; after it returns the watchdog no longer calls `who`.
void UnwatchSites(StuckListener* who);

}  // namespace mori::ccl
