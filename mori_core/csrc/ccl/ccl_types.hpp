// Types shared by the host side and the kernels of MORI-CCL (mori_core.ccl):
// what a handle does, which engine moves the bytes, the tuning options, the
// error record the device and the watchdog fill, and the kernels' arguments.
#pragma once

#include <cstdint>

namespace mori::ccl {

// One node: at most 8 GPUs reach each other through CUDA IPC.
constexpr int kMaxPeers = 8;
// The SM kernels' barrier flags are sized for this many blocks.
constexpr int kMaxSmBlocks = 128;

enum class Kind : int { kAllGather = 0, kAllToAll = 1, kAllReduce = 2 };

// kAuto picks by size; kCopy = copy engines (cudaMemcpyAsync between IPC-mapped heap
// buffers, synchronised by stream memory operations: no SM moves or waits); kSm = kernels.
enum class Engine : int { kAuto = 0, kCopy = 1, kSm = 2 };

// What one call ran (the benchmarks print it).
enum class Path : int {
  kNone = 0,
  kSmAllGather = 1,
  kSmAllToAll = 2,
  kSmOneShot = 3,  // all-reduce: push to every peer, reduce locally
  kSmTwoShot = 4,  // all-reduce: reduce-scatter (push) + all-gather (pull)
  kCeAllGather = 5,
  kCeAllToAll = 6,
  kCeAllReduce = 7,  // reduce-scatter pushed by copy engines, a local reduce kernel, all-gather pulled by copy engines
};

// A synchronous call runs kFull; start_async runs kStart and wait_async kFinish.
enum Phase : int { kPhaseStart = 1, kPhaseFinish = 2, kPhaseFull = 3 };

// Element type of an all-reduce (sum). kI32 also serves uint32 (same bits mod 2^32).
enum class RedType : int { kNone = 0, kF32 = 1, kF16 = 2, kBF16 = 3, kI32 = 4 };

inline int RedTypeSize(RedType t) {
  switch (t) {
    case RedType::kF32:
    case RedType::kI32:
      return 4;
    case RedType::kF16:
    case RedType::kBF16:
      return 2;
    default:
      return 1;
  }
}

// A size threshold that is never reached ("off").
constexpr uint64_t kNeverBytes = 1ull << 62;
// Most streams (copy engines in flight) per peer of the copy-engine path.
constexpr int kMaxCeSplit = 8;

// The defaults mirror mori_core.ccl.options (which always passes every field).
struct Options {
  Engine engine = Engine::kAuto;
  // kAuto, all-gather / all-to-all: copy engines from this many bytes of input per rank.
  uint64_t ce_min_bytes = kNeverBytes;
  // kAuto / kSm, all-reduce: one-shot up to this many bytes, two-shot above.
  uint64_t oneshot_max_bytes = 512ull << 10;
  // kAuto, all-reduce: copy engines from this many bytes.
  uint64_t ar_ce_min_bytes = kNeverBytes;
  int sm_blocks = 64;       // grid of the SM collectives (fixed per handle; <= kMaxSmBlocks)
  int sm_threads = 512;     // threads per block of every kernel
  int reduce_blocks = 0;    // grid of the copy-engine all-reduce's local reduce (0: 2 per SM)
  double timeout_s = 30.0;  // bound of every wait for a peer
  bool ce_batch = true;     // one batched stream-memory-operation call per group of waits/writes
  bool ce_signal_copy = false;  // signal peers with 4-byte copies instead of stream write operations
  // Copy engines: each peer's copy is split into up to this many pieces, each on its own stream
  // (one cudaMemcpyAsync keeps one copy engine busy; pieces put several in flight per peer). On
  // 4x H100 more pieces did not raise the rate with three peers at once and made the all-to-all
  // slower at >= 64 MiB (docs/ccl.md, "Sweep" and "Copy-engine ceilings").
  int ce_split = 2;
  uint64_t ce_piece_min_bytes = 1ull << 20;  // no piece smaller than this
};

// Host-mapped; written once (first failure wins) by a kernel or by the copy-engine watchdog.
struct ErrorRecord {
  uint32_t code;    // kErrNone / kErrTimeout
  int32_t peer;     // the rank that did not arrive
  int32_t block;
  uint32_t epoch;
  uint32_t where;   // a WaitSite (kernels) or the watchdog's site id + 100
};
constexpr uint32_t kErrNone = 0;
constexpr uint32_t kErrTimeout = 1;

// Where a kernel waited (named in the error message).
enum WaitSite : uint32_t {
  kSiteStaged = 1,   // all-gather / all-to-all: the peer's input staged
  kSitePushed = 2,   // all-reduce: the peer's data pushed into this rank's slots
  kSiteReduced = 3,  // two-shot: the peer's reduced shard ready
  kSiteClose = 4,    // close(): the peer closing its handle
};

// The SM engine's barrier state: a per-handle epoch (advanced by the last block of every
// finishing kernel, so CUDA graphs replay it correctly) and per-block flags in every peer.
struct SmSync {
  uint32_t* epoch;
  uint32_t* done;
  uint32_t* claim;                       // elects the one block that fills the error record
  uint32_t* flags[2];                    // this rank's flags [kMaxSmBlocks][npes], barriers A and B
  uint32_t* peer_flags[2][kMaxPeers];    // the same arrays in each peer's heap (mapped here)
  ErrorRecord* error;                    // device alias of the host-mapped record
  uint64_t timeout_ns;
  int rank;
  int npes;
};

// Arguments of one SM collective. Buffers with a parity hold two copies (even / odd epoch).
struct SmArgs {
  const uint8_t* in;
  uint8_t* out;
  uint64_t nbytes;        // all-gather: bytes per rank; all-to-all: bytes per peer chunk; all-reduce: total
  uint64_t count;         // all-reduce: elements
  uint64_t shard;         // two-shot: elements per shard (a multiple of one 16-byte vector)
  uint8_t* buf;           // stage / slots in this rank's heap, parity 0
  uint8_t* peer_buf[kMaxPeers];
  uint64_t buf_parity;    // bytes from parity 0 to parity 1
  uint64_t slot_bytes;    // all-reduce: bytes per source slot
  uint8_t* red;           // two-shot: reduced shard, parity 0
  uint8_t* peer_red[kMaxPeers];
  uint64_t red_parity;
};

// Arguments of the copy-engine all-reduce's local reduce kernel.
struct CeReduceArgs {
  const uint8_t* in;
  uint8_t* out;
  uint8_t* red;            // this rank's reduced shard (peers pull it)
  const uint8_t* slots;    // [npes][slot_bytes]: what each peer pushed
  uint64_t slot_bytes;
  uint64_t shard;          // elements per shard
  uint64_t len;            // elements of this rank's shard
  int rank;
  int npes;
};

}  // namespace mori::ccl
