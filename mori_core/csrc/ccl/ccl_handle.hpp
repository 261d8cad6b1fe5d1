// CclHandle: one MORI-CCL collective (all-gather, all-to-all or all-reduce) of one rank on
// the symmetric heap. It owns the heap buffers and flags of the engines it may use, the
// streams and events of the copy-engine path, the error record, and the async state.
//
// Copy-engine path (zero SMs move or wait): each rank copies ("stages") its input into its
// heap and the peers pull it with cudaMemcpyAsync over NVLink, one stream per peer, so the
// copies run on several copy engines at once; ranks synchronise with stream memory
// operations on flags in each other's heaps. The flags toggle (the waiter resets what it
// consumed), because a CUDA graph replays fixed values: a peer's "ready" for the next call
// can only come after it saw this rank's "freed", which this rank writes after its reset.
//
// SM path: one kernel per call (two with start_async/wait_async), a per-block flag barrier
// with an epoch kept on the device (graph-safe), a bounded spin that names a missing peer.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "ccl/ccl_types.hpp"
#include "ccl/ce_watchdog.hpp"
#include "common/gpu_runtime.hpp"

#if MORI_WITH_GPU
namespace mori::ccl {

class CclHandle : public StuckListener {
 public:
  // Collective over the shmem ranks (every rank constructs the same handle in the same
  // order). `input_bytes` bounds one call's input per rank. `red` is the all-reduce's dtype.
  CclHandle(Kind kind, int rank, int npes, uint64_t input_bytes, RedType red, const Options& opt);
  ~CclHandle() override;
  CclHandle(const CclHandle&) = delete;
  CclHandle& operator=(const CclHandle&) = delete;

  // One call on `stream`. `nbytes`: all-gather: input bytes per rank; all-to-all: bytes of
  // one peer's chunk; all-reduce: input bytes. Returns the path that ran (kNone for 0 bytes).
  Path Run(uintptr_t in, uintptr_t out, uint64_t nbytes, uintptr_t stream);
  // start_async: the sending half on `stream`; Finish: the rest on `stream` (may differ).
  Path Start(uintptr_t in, uintptr_t out, uint64_t nbytes, uintptr_t stream);
  Path Finish(uintptr_t stream);
  bool async_pending() const { return pending_.active; }

  // The path a call of `nbytes` takes.
  Path Choose(uint64_t nbytes) const;
  // Collective teardown: a last barrier so no peer still uses this rank's buffers, then the
  // heap buffers go. Idempotent; the destructor calls it.
  void Close();
  // Collective: every rank must call it with no call in flight; zeroes the flags and epoch.
  void ResetFlags();
  // "" while healthy, else what failed (names the peer). A failed handle refuses calls.
  std::string Error() const;

  int device() const { return device_; }
  uint64_t heap_bytes() const { return heap_bytes_; }
  uint64_t sync_offset() const { return sync_offset_; }
  const Options& options() const { return opt_; }
  bool ce_available() const { return ce_enabled_; }

  bool OnStuck(int site) override;

 private:
  struct Region {
    uint8_t* local = nullptr;
    uint8_t* peer[kMaxPeers] = {};
    uint64_t bytes = 0;
  };
  // Where a copy-engine stream waits; `peers` are the ranks whose flags it waits for.
  struct CeSite {
    std::string name;
    std::vector<int> peers;
    uint32_t* flags = nullptr;  // this rank's flag array indexed by peer
  };
  struct Pending {
    bool active = false;
    Path path = Path::kNone;
    uintptr_t in = 0, out = 0;
    uint64_t nbytes = 0;
    gpuStream_t stream = nullptr;
  };

  Region Alloc(uint64_t bytes);
  void Free(Region& r);
  void ThrowIfFailed() const;
  void OrderAfterLast(gpuStream_t s);
  void MarkLast(gpuStream_t s);
  SmArgs MakeSmArgs(Path path, uintptr_t in, uintptr_t out, uint64_t nbytes) const;
  int SmBlocks(Path path, uint64_t nbytes) const;
  uint64_t ShardElems(uint64_t count) const;
  void LaunchSm(Path path, uintptr_t in, uintptr_t out, uint64_t nbytes, int phase, gpuStream_t s);

  // Copy-engine path (ce_collectives.cpp).
  void CeStart(Path path, uintptr_t in, uintptr_t out, uint64_t nbytes, gpuStream_t s);
  void CeFinish(gpuStream_t s);
  void CeCopy(gpuStream_t s, void* dst, const void* src, uint64_t bytes);
  // A copy to or from peer p on its stream t, split over t and p's piece streams.
  void CePeerCopy(int p, gpuStream_t t, void* dst, const void* src, uint64_t bytes);
  void CeSignal(gpuStream_t s, const std::vector<std::pair<uint32_t*, uint32_t>>& writes);
  void CeWait(gpuStream_t s, int site, uint32_t* flags, const std::vector<int>& peers);
  int AddSite(const std::string& name, uint32_t* flags, const std::vector<int>& peers);

  Kind kind_;
  int rank_, npes_, device_;
  uint64_t input_bytes_;
  RedType red_;
  int esize_;
  Options opt_;
  uint64_t generation_;
  uint64_t heap_bytes_ = 0;
  uint64_t sync_offset_ = 0;
  bool closed_ = false;

  // SM engine: sync block (epoch, done, claim, flags A/B, copy-engine flags) and buffers.
  Region sync_;
  SmSync sm_{};
  bool sm_enabled_ = false, twoshot_enabled_ = false;
  Region sm_buf_, sm_red_;        // stage (all-gather / all-to-all) or one-shot slots; two-shot reduced
  Region ts_buf_;                 // two-shot slots
  uint64_t sm_slot_bytes_ = 0, ts_slot_bytes_ = 0;
  uint64_t sm_cap_ = 0, ts_cap_ = 0;  // bytes the SM paths accept
  int sm_count_ = 0;              // SMs of the device

  // Copy-engine engine.
  bool ce_enabled_ = false;
  Region ce_buf_, ce_red_;
  uint64_t ce_slot_bytes_ = 0;
  uint32_t* ce_freed_ = nullptr;  // [npes] in sync_: peer p finished reading this rank's buffers
  uint32_t* ce_ready_ = nullptr;  // [npes]: peer p's data is staged / pushed
  uint32_t* ce_ready2_ = nullptr; // [npes]: all-reduce: peer p's reduced shard is ready
  uint32_t* ce_consts_ = nullptr; // device words {0, 1}: sources of copy-mode signals
  uint32_t* ce_peer(uint32_t* local, int p) const;
  std::vector<gpuStream_t> streams_;  // [0, npes): per-peer streams (own index: own chunk); [npes]: main
  std::vector<gpuEvent_t> join_ev_;   // one per stream
  // ce_split - 1 extra streams per peer ([p * (ce_split - 1) + j]); forked from and joined back
  // into streams_[p] around each split copy, so the rest of the protocol sees one stream per peer.
  std::vector<gpuStream_t> piece_streams_;
  std::vector<gpuEvent_t> piece_fork_ev_;  // [npes]
  std::vector<gpuEvent_t> piece_join_ev_;  // like piece_streams_
  gpuEvent_t fork_ev_ = nullptr, fork_main_ev_ = nullptr, last_ev_ = nullptr;
  gpuStream_t last_stream_ = nullptr;
  bool has_last_ = false;
  std::vector<CeSite> sites_;
  uint32_t* busy_host_ = nullptr;  // host-mapped words, one per site
  uint32_t* busy_dev_ = nullptr;
  gpuStream_t diag_stream_ = nullptr;
  bool watched_ = false;

  ErrorRecord* err_host_ = nullptr;
  ErrorRecord* err_dev_ = nullptr;
  mutable std::mutex err_mu_;
  std::string ce_error_;  // set by the watchdog
  Pending pending_;
};

const char* PathName(Path p);

}  // namespace mori::ccl
#endif
