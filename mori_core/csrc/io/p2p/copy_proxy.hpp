// An opt-in persistent copy kernel for small XGMI transfers (issue 12).
//
// Why: a transfer through the scatter-copy kernel pays one kernel launch on
// the host (3-5 us of driver time on the GPU machine's VMs) and the GPU's
// launch-to-completion latency (~6 us) however few bytes it moves, so a lone
// 8 KiB write cannot get under ~10 us that way. The proxy removes both: a
// grid of `blocks` blocks stays resident on the initiator's GPU and takes
// descriptors from a ring in pinned host memory. Posting is a few stores to
// host memory; the GPU sees them with one PCIe read; completion is the same
// host-mapped signal word the scatter kernel writes (signal_slots.hpp).
//
// Costs, and why it is off by default: the grid holds `blocks` + 1 SMs while it is
// resident and spins on the user's GPU; a device-wide synchronize
// (torch.cuda.synchronize, cudaDeviceSynchronize) waits for the grid, which
// leaves `idleUs` after the last transfer it saw. Streams of other work are not
// affected (the proxy's stream does not synchronize with the legacy stream).
//
// Protocol (posters are serialized by a mutex):
//  * host: writes entry n into ring slot n % 64, every 8-byte word tagged with
//    n + 1 (copy_proxy.cu: a word with the right tag is complete, so no
//    separate ready flag), then, after a full fence, reads ctl.state; if no
//    grid claims to be running it sets state = running and launches one
//    (stream order keeps grids one at a time);
//  * grid: block 0 is the leader (one warp): it polls the ring in host memory,
//    copies each complete entry into device memory for the other blocks (one
//    reader of host memory: many SMs reading the same host words contend) and
//    then bumps ctl.consumed (the host reuses a ring slot only behind it);
//    the `blocks` copy blocks take their share (4 KiB pieces over all their
//    warps, so an entry of <= 16 pieces is the first copy block's alone); the
//    last block with pieces to finish writes the transfer's signal word;
//  * idle exit: after `idleUs` without an entry the leader stores state =
//    exiting, fences, and looks at the ring once more (the host's mirror image
//    of that sequence is in Post). Either it sees the new entry and goes on,
//    or the host sees "exiting" and launches the next grid, which starts where
//    this one stopped (the consumed count lives in device memory). Both at once
//    costs one extra grid that idles out; neither cannot happen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/gpu_runtime.hpp"
#include "io/p2p/scatter_copy.hpp"

namespace mori::io::p2p {

// Limits are checked where the values come in (XgmiBackend: config fields and
// environment variables), so errors name what the user set.
struct ProxyConfig {
  int blocks = 0;                  // 0 = no proxy; else copy blocks, [1, 64] (+1 leader block)
  uint64_t maxBytes = 1ull << 20;  // larger transfers use a launch: [4 KiB, 256 MiB]
  uint32_t idleUs = 500;           // the grid exits after this long without work: [10, 10^7]
};

// Shared with the kernel (defined in copy_proxy.cu).
struct ProxyEntry;
struct ProxyControl;
struct ProxyDeviceState;

class CopyProxy {
 public:
  static constexpr uint32_t kMaxSegments = 64;  // per transfer; more segments take a launch
  static constexpr uint32_t kRing = 64;         // transfers in flight; more take a launch
  static constexpr uint32_t kThreads = 512;
  static constexpr uint32_t kMaxBlocks = 64;

  // Allocates the ring and state on `device` (current) and its stream; no grid yet.
  CopyProxy(int device, const ProxyConfig& config);
  // Asks a running grid to leave and waits for it (bounded); throws nothing.
  ~CopyProxy();
  CopyProxy(const CopyProxy&) = delete;
  CopyProxy& operator=(const CopyProxy&) = delete;

  // Takes the copy if it fits (segments, bytes, ring room) and returns true;
  // false leaves it to the caller's launch path. `signal.flag` gets
  // `signal.value` when every byte landed. Throws GpuError if a grid could
  // not be launched.
  bool Post(const CopySeg* segs, size_t count, uint64_t totalBytes, const KernelSignal& signal);
  gpuStream_t Stream() const { return stream_; }
  // Grids launched so far (a grid per busy period; tests use it).
  uint64_t Launches() const;

 private:
  void LaunchGrid();

  const int device_;
  const ProxyConfig config_;
  gpuStream_t stream_ = nullptr;
  ProxyEntry* ring_ = nullptr;         // pinned host memory, host view
  ProxyEntry* ringDev_ = nullptr;      // device view
  ProxyControl* ctl_ = nullptr;        // pinned host memory, host view
  ProxyControl* ctlDev_ = nullptr;     // device view
  ProxyDeviceState* state_ = nullptr;  // device memory
  mutable std::mutex mu_;
  uint32_t head_ = 0;              // entries posted
  uint32_t epoch_ = 0;             // grids launched
  bool broken_ = false;            // a launch failed: take nothing more
};

// The floor under any host-fed resident kernel: host stores a word in pinned
// memory, a one-thread kernel on `device` that polls it stores an answer, the
// host sees it. Microseconds per round trip, `iters` of them (the benchmark
// prints the median beside the proxy's latency). Throws GpuError, or BadState
// if an answer does not come within a second.
std::vector<double> PinnedPingPongUs(int device, int iters);

}  // namespace mori::io::p2p
