// Types shared by the EP host code and kernels: geometry, buffer table, the
// device-side sync state and the host-visible error record.
#pragma once

#include <cstdint>

#ifndef MORI_ENABLE_PROFILER
#define MORI_ENABLE_PROFILER 0
#endif

namespace mori::ep {

constexpr int kMaxWorld = 8;  // IntraNode: the GPUs of one node

// Error codes written by the kernels into EpErrorRecord::code (0 = none).
enum EpErrorCode : int32_t {
  kErrNone = 0,
  kErrTimeout = 1,          // peer never signalled within the timeout
  kErrSendOverflow = 2,     // a destination's receive capacity was exceeded
  kErrRecvOverflow = 3,     // this rank was sent more rows than it can hold
  kErrCombineRows = 4,      // combine input has fewer rows than tokens received
  kErrCombineWeightRows = 5,
  kErrRoutingMismatch = 6,  // combine indices route a token differently than dispatch
  kErrStdStale = 7,         // standard-MoE combine/convert without a standard-MoE layout of this dispatch
  kErrConvertRows = 8,      // convert_dispatch_output got fewer rows than tokens received
};
// Combine-side transport quantisation (EpDispatchCombineConfig.quant_type).
enum EpCombineQuant : int32_t {
  kQuantNone = 0,
  kQuantFp8Cast = 1,   // fp8_direct_cast: every element saturated to e4m3, no scale
  kQuantFp8Block = 2,  // fp8_blockwise: one fp32 scale per 128-channel block
};
constexpr int kFp8BlockElems = 128;
// Staged push combine: a source's tokens are cut into at most this many chunks; the rows of
// chunk k are pushed (and signalled) before those of chunk k + 1, so the receiver reduces
// chunk k while chunk k + 1 is still crossing the links.
constexpr int kMaxPushStages = 16;
// Combine kernel modes (CombineParams::mode, EpHandle::Combine's `mode`).
enum EpCombineMode : int32_t {
  kCombinePull = 0,      // sources read this rank's registered rows (zero-copy)
  kCombinePush = 1,      // this rank writes every row into its source's staging buffer
  kCombineCopyPull = 2,  // the caller's rows are copied into the registered buffer, then pull
  // Pull, except that a round whose every source dispatched at most pull_push_tokens tokens
  // runs the push algorithm on the registered rows (one launch; decided on the device).
  kCombinePullOrPush = 3,
};
// How a dispatch ranks rows for the standard-MoE layout (DispatchParams::standard_moe).
enum EpStdMode : int32_t {
  kStdOff = 0,      // plain 2-D dispatch
  kStdPlanned = 1,  // StdPlanKernel ran first: positions from its bitmaps and prefix counts
  kStdFused = 2,    // the dispatch kernel ranks its own tokens (ep_std_layout.cuh), no plan kernel
  kStdOneLaunch = 3,  // kStdFused, and the expand is the dispatch kernel's tail (no expand kernel)
};
enum EpPhase : int32_t { kPhaseDispatch = 1, kPhaseCombine = 2 };

// Per-source arrival counters (the IntraNode dispatch's completion and the combine's barriers:
// dispatch_flags, combine_flags, push_flags). Once a block has written
// everything of a round, it adds its share to its source's counter on every destination; the
// shares of one source's blocks add up to 1 << kArriveShift per round whatever its grid (block 0
// adds the complement of the others'), so a destination knows that a source's round r is
// complete when that counter reaches r << kArriveShift, without knowing the source's grid. The
// counters wrap like the round flags: a source is at most one round ahead of a destination's
// wait (its next round needs this destination's next blocks, which start after the wait).
constexpr int kArriveShift = 16;
// Blocks of one arriving launch: the dispatch checks it; the combine's grids are clamped to what
// fits on the GPU at once, far below.
constexpr int kMaxArriveBlocks = (1 << kArriveShift) - 1;

// Host-mapped (pinned) memory: kernels write, the host reads without syncing.
// `code` is written last, after a system fence, so a non-zero code means the
// other fields are complete.
struct EpErrorRecord {
  int32_t code;
  int32_t phase;
  int32_t peer;
  int32_t block;
  int64_t a;
  int64_t b;
};

// Per-rank device state, updated only by the kernels (so everything is
// graph-capturable and resets itself).
struct EpSyncState {
  uint32_t dispatch_epoch;   // dispatch rounds completed
  uint32_t combine_epoch;
  uint32_t combine_arrive;   // push combine: blocks done with the round (the last advances combine_epoch)
  int32_t total_recv;        // rows received by the last dispatch (the Python total_recv tensor)
  int32_t dispatch_tokens;   // tokens this rank sent in the last dispatch
  int32_t failed;            // set once any kernel of this op reported an error
  int32_t error_claim;       // first reporter wins
  int32_t combine_items[2];  // combine work queue heads, by round parity (each launch clears the other)
  uint32_t plan_arrive;      // blocks of the standard-MoE plan / converter that finished
  uint32_t std_round;        // dispatch round whose standard-MoE layout is current (0: none)
  int32_t dispatch_weighted; // the last dispatch carried gating weights
  int32_t plan_words[2];     // token-bitmap words the plan of each parity set (cleared before its reuse)
  // Standard-MoE plans run so far (plan kernels, or fused standard-MoE dispatches): the token
  // bitmaps alternate per plan (parity std_plans & 1), not per dispatch round, because plain
  // dispatches may run between two plans and each plan clears the bitmap the plan before it set.
  uint32_t std_plans;
  // Staged push combine: the work-queue heads of each chunk's reduce, by combine round parity
  // (each launch clears the other).
  int32_t stage_items[2][kMaxPushStages];
};

struct EpGeometry {
  int32_t rank;
  int32_t world;
  int32_t topk;
  int32_t experts_per_rank;
  int32_t num_experts;
  int32_t max_tok;        // max_num_inp_token_per_rank
  int32_t max_recv;       // receive capacity (rows of the dispatch outputs)
  int32_t max_send;       // world * max_tok: stride of the flat source index
  int32_t scale_bytes;    // bytes of one token's scales (0: none)
  int32_t pad_;
  uint64_t timeout_ns;
  int32_t tpe;            // standard MoE: rows per local expert (world * max_tok)
  int32_t tok_words;      // 32-bit words of a max_tok-bit token bitmap
};

// Addresses in THIS rank's heap; peer pe's twin is at `ptr + peer_delta[pe]`.
struct EpBuffers {
  // symmetric (peers write or read them)
  uint8_t* dispatch_out;        // [max_recv][row]
  float* dispatch_out_weights;  // [max_recv][topk]
  int32_t* dispatch_out_indices;
  uint8_t* dispatch_out_scales; // [max_recv][scale_bytes]
  int32_t* src_pos;             // [max_recv] flat source index
  uint8_t* combine_inp;         // [max_recv][row] registered (zero-copy) combine input
  float* combine_inp_weights;   // [max_recv][topk] pull-mode weight staging
  uint8_t* stage;               // [world][max_tok][row] push-mode combine staging
  float* stage_weights;         // [world][max_tok][topk]
  int32_t* recv_counter;        // [2] slot reservation counters (by round parity)
  uint32_t* dispatch_flags;     // [kMaxWorld] arrival units of each source's dispatch blocks (kArriveShift)
  uint32_t* combine_flags;      // [kMaxWorld] pull combine: arrival units of each source (kArriveShift)
  // local only
  uint8_t* combine_out;         // [max_tok][row]
  float* combine_out_weights;   // [max_tok][topk]
  int32_t* dest_slot;           // [max_tok][world]: slot of token t on rank r, -1 if none
  uint32_t* token_mask;         // [max_tok]: destination-rank bit mask of token t
  EpSyncState* sync;
  EpErrorRecord* error;         // device alias of the host-mapped record
  // standard-MoE count exchange (symmetric, zeroed with the op; written by peers)
  int32_t* std_counts;          // [2][world][num_experts]: rows each source sends to each expert, by round parity
  uint32_t* std_flags;          // [kMaxWorld]: round whose counts each source's plan kernel published
                                // (the fused dispatch sends the counts before its round signal instead)
  // symmetric, written by peers: tokens each source dispatched, by dispatch round parity
  // ([2][kMaxWorld]; the staged push combine cuts every source's tokens into the same chunks
  // on both sides), and the arrival units of each source's pushers per chunk k
  // ([kMaxPushStages][kMaxWorld], kArriveShift).
  int32_t* peer_tokens;
  uint32_t* push_flags;
  // Overlapped push combine: [world][max_tok] symmetric, written by peers: the combine round whose
  // row for source token t each rank r has pushed into this rank's staging (slot [r][t]).
  uint32_t* push_rows;
#if MORI_ENABLE_PROFILER
  int64_t* prof_events;         // [kProfMaxWarps][kProfEventsPerWarp][2] (time ns, meta)
  int32_t* prof_cursor;         // [kProfMaxWarps] events written per warp slot
#endif
};

// Standard-MoE (DeepEP 3-D) layout buffers, allocated on first use (null before).
struct EpStdBuffers {
  uint8_t* packed_x;            // [E_local][tpe][row] symmetric: peers write rows here
  uint8_t* packed_scales;       // [E_local][tpe][scale_bytes] symmetric
  int32_t* packed_src_info;     // [E_local][tpe] symmetric: flat source index of each row
  int32_t* std_row;             // [max_recv][topk]: packed row of (received token, k) on this rank, -1 if not local
  int32_t* std_rel;             // [max_recv][topk] symmetric: the same row's position among its source's rows of
                                // that expert (written by the source's dispatch; -1 if not local)
  int32_t* packed_count;        // [E_local]
  int64_t* layout_range;        // [E_local][world]: rows from each source, (count | begin << 32)
  uint32_t* plan_bits;          // [2][num_experts][tok_words] source side: token bitmap per expert, by parity
  int32_t* plan_prefix;         // [num_experts][tok_words] exclusive prefix popcount per word
  uint32_t* conv_bits;          // [E_local][world * tok_words] converter: source-token bitmap per local expert
  int32_t* conv_prefix;         // [E_local][world * tok_words]
};

struct EpKernelArgs {
  EpGeometry geo;
  EpBuffers buf;
  int64_t peer_delta[kMaxWorld];
  EpStdBuffers std;
};

// The rows a dispatch sends: the fields the dispatch parameters of both kernel
// families start with (DispatchParams, inter::InterDispatchParams), filled by
// FillDispatchPointers.
struct DispatchRows {
  const uint8_t* input;
  const float* weights;   // nullable
  const uint8_t* scales;  // nullable
  const int32_t* indices;
  int32_t num_tokens;
  int32_t row_bytes;
};

struct DispatchParams : DispatchRows {
  // EpStdMode: 0 plain; else every row also carries its position among this rank's rows of each
  // of its experts (1: ranked by the plan kernel before, 2 and 3: by the dispatch kernel itself)
  int32_t standard_moe;
  // Blocks that send tokens (0: all). kStdOneLaunch launches more blocks for its expand tail.
  int32_t send_blocks;
  // 1: each copy item stores to one destination rank (see the dispatch kernel's step 4).
  int32_t per_dest;
};

struct CombineParams {
  const uint8_t* input;
  const float* weights;  // nullable
  const int32_t* indices;
  int32_t row_bytes;
  int32_t input_rows;
  int32_t weight_rows;
  // 1: this rank's own rows and weights also go through its staging buffer. Needed when `input`
  // or `weights` lie in this rank's dispatch outputs: a peer that finished this combine may start
  // its next dispatch and overwrite them while this rank still reduces.
  int32_t stage_own;
  int32_t num_tokens;
  int32_t check_input_rows;   // push and copy-pull read `input`; pull mode reads combine_inp
  int32_t quant;              // EpCombineQuant of the rows that cross the link
  int32_t standard_moe;       // 1: `input` is the 3-D standard-MoE layout (push only)
  int32_t copy_input;         // pull kernel: first copy `input` rows into this rank's registered buffer
  // Staged push: tokens per chunk (0: one chunk, i.e. push everything, one barrier, reduce), and
  // how many blocks only reduce while the others push (the pushers join them when done).
  int32_t stage_tokens;
  int32_t reduce_blocks;
  // Overlapped push (unstaged rounds only): each pushed row is flagged to its source. On when the
  // round's dispatched tokens (all sources: the same number on every rank) reach
  // `overlap_tokens`; -1: never. Then the overlap kernel (`overlap_kernel`, the host's choice per
  // call; ranks may differ) has its last `overlap_reduce_blocks` blocks (0: every block once it
  // has pushed) sum each token as soon as its rows are there; the plain kernel reduces after
  // every rank has pushed everything.
  int32_t overlap_tokens;
  int32_t overlap_reduce_blocks;
  int32_t overlap_kernel;
  // Pull kernel (kCombinePullOrPush): rounds whose every source dispatched at most this many
  // tokens push instead (0: never). Every rank decides alike: each holds every source's count.
  int32_t pull_push_tokens;
};

}  // namespace mori::ep
