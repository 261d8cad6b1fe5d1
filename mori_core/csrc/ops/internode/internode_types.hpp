// Types of the inter-node EP kernels (InterNode, InterNodeV1, InterNodeV1LL,
// AsyncLL): geometry, the buffer table and the per-call parameters.
//
// Ranks are grouped into nodes of `gpn` GPUs (rank = node * gpn + local).
// Two kinds of memory are used:
//   * the node-local symmetric heap of mori_core.shmem (CUDA IPC): peers of
//     the same node write into each other's receive buffers over NVLink;
//   * NVSHMEM's symmetric heap: the only memory that crosses the network.
//     Rank (n, l) exchanges rows only with its "proxy" (m, l) on every other
//     node m: a token crosses the network at most once per destination node.
// A network peer whose NVSHMEM heap this GPU can address (nvshmem_ptr is not
// null: the same NVLink domain) is written with plain stores by every warp
// ("direct"); every other peer gets NVSHMEM puts of rows staged locally, issued
// in chunks by the warps that staged them ("put"). InterBuffers::net_peer_delta
// tells which, per peer node; the handle can force every peer onto puts.
#pragma once

#include <cstdint>

#include "ops/ep_types.hpp"

#if defined(__CUDACC__)
#define MORI_INTER_HD __host__ __device__
#else
#define MORI_INTER_HD
#endif

namespace mori::ep::inter {

constexpr int kMaxWorld = 64;  // destination masks are uint64
constexpr int kMaxLocal = 8;   // GPUs of one node (one NVLink domain)

// Phases named in error records (beyond IntraNode's dispatch/combine).
enum InterPhase : int32_t {
  kPhaseDispatchSend = 11,
  kPhaseDispatchRecv = 12,
  kPhaseCombineSend = 13,
  kPhaseCombineRecv = 14,
};

// Blocks of each launch that arrive at a "last block" point (one counter each).
enum ArriveSlot : int { kArriveDispatchSend = 0, kArriveDispatchRecv = 1, kArriveCombinePrep = 2,
                        kArriveCombineSend = 3, kArriveCombineRecv = 4, kArriveSlots = 8 };

// Per-phase device timestamps (globaltimer ns) of the last kPhaseRing rounds of
// each direction, written by the kernels (one store per point; always on) and
// read by the benchmark to show where a call's time goes. Dispatch points are
// indexed by the dispatch round, combine points by the combine round.
enum PhasePoint : int {
  kTDispSendStart = 0,   // block 0 entered the send launch
  kTDispSendCopied,      // the last send block finished its rows (writes issued)
  kTDispSendSignalled,   // puts completed (quiet) and every peer node signalled
  kTDispRecvStart,       // block 0 entered the receive launch
  kTDispRecvArrived,     // block 0 saw every peer node's signal
  kTDispRecvForwarded,   // the last block finished forwarding rows inside the node
  kTDispRecvDone,        // node barrier passed: total_recv final
  kTCombPrepStart,       // (gpu_per_node > 1 only) prep launch entered
  kTCombPrepDone,        // registered buffer staged, node peers told
  kTCombSendStart,       // block 0 entered the send launch
  kTCombSendReady,       // block 0 saw every node peer's buffer ready
  kTCombSendCopied,      // the last block finished the partial rows
  kTCombSendSignalled,   // puts completed and every peer node signalled
  kTCombRecvStart,       // block 0 entered the receive launch
  kTCombRecvArrived,     // block 0 saw every peer node's partials
  kTCombRecvDone,        // the last block finished the sums
  kPhasePoints = 16
};
constexpr int kPhaseRing = 64;  // rounds kept per direction

struct InterGeometry {
  int32_t rank, world, gpn, nodes, node, local;
  int32_t topk, experts_per_rank, num_experts;
  int32_t max_tok;      // max_num_inp_token_per_rank
  int32_t max_recv;     // receive capacity of the dispatch outputs
  int32_t max_send;     // world * max_tok: stride of the flat source index
  int32_t scale_bytes;  // bytes of one token's scales (0: none)
  int32_t disp_stride_cap;  // bytes of one network dispatch row at the op's maximum row size
  int32_t comb_stride_cap;  // bytes of one network combine row at the op's maximum row size
  int32_t put_peers;        // peer nodes reached by NVSHMEM puts (0: every peer node is direct)
  uint64_t timeout_ns;
};

struct InterBuffers {
  // node-local symmetric (IPC heap): node peers write/read them over NVLink
  uint8_t* dispatch_out;        // [max_recv][row]
  float* dispatch_out_weights;  // [max_recv][topk]
  int32_t* dispatch_out_indices;
  uint8_t* dispatch_out_scales;  // [max_recv][scale_bytes]
  int32_t* src_pos;              // [max_recv]
  uint8_t* combine_inp;          // [max_recv][row] registered combine input (read by node peers)
  float* combine_inp_weights;    // [max_recv][topk]
  int32_t* recv_counter;         // [2] slot reservation counters by round parity
  uint32_t* dispatch_flags;      // [kMaxLocal] round signalled by each node peer
  uint32_t* combine_flags;       // [kMaxLocal]
  // network symmetric (NVSHMEM heap); [2] = round parity, [nodes] = peer node
  uint8_t* net_send;        // [2][nodes][max_tok][disp_stride_cap] rows staged for node m
  uint8_t* net_recv;        // [2][nodes][max_tok][disp_stride_cap] rows received from node n
  uint64_t* net_disp_sig;   // [2][nodes] (round << 32 | rows) from node n
  uint8_t* net_comb_send;   // [2][nodes][max_tok][comb_stride_cap] partial sums for node n
  uint8_t* net_comb_recv;   // [2][nodes][max_tok][comb_stride_cap] partial sums from node m
  uint64_t* net_comb_sig;   // [2][nodes]
  // local only
  uint8_t* combine_out;        // [max_tok][row]
  float* combine_out_weights;  // [max_tok][topk]
  int32_t* local_slot;         // [max_tok][gpn]: slot of own token t on node peer l, -1 if none
  int32_t* node_slot;          // [max_tok][nodes]: staging row of own token t for node m, -1 if none
  int32_t* fwd_slot;           // [nodes][max_tok][gpn]: slot of forwarded row (n, j) on node peer l
  int32_t* net_counter;        // [nodes] network rows reserved for node m by the running dispatch
  int32_t* net_row_tok;        // [nodes][max_tok]: own token of network row j for node m (running dispatch)
  int64_t* net_peer_delta;     // [nodes]: byte distance from net_send's allocation to node m's proxy's twin, 0: puts
  int64_t* phase_ns;           // [2][kPhaseRing][kPhasePoints] (dispatch, combine) timestamps
  int32_t* recv_rows;          // [nodes] rows received from node n by the last dispatch
  uint64_t* token_mask;        // [max_tok] destination-rank mask of own token t
  uint32_t* arrive;            // [kArriveSlots]
  EpSyncState* sync;
  EpErrorRecord* error;        // device alias of the host-mapped record
};

struct InterArgs {
  InterGeometry geo;
  InterBuffers buf;
  int64_t peer_delta[kMaxLocal];  // byte distance from this rank's IPC heap to node peer l's
};

struct InterDispatchParams : DispatchRows {
  int32_t stride;        // bytes of one network row for this call
  int32_t rdma_blocks;   // blocks [0, rdma_blocks) stage network rows, the rest write node peers (0: all do both)
  int32_t put_rows;      // network rows per NVSHMEM put (put path)
};

struct InterCombineParams {
  const uint8_t* input;   // push mode: rows in dispatch-output order
  const float* weights;   // nullable
  const int32_t* indices;
  int32_t row_bytes;
  int32_t stride;         // bytes of one network partial row for this call
  int32_t input_rows;
  int32_t weight_rows;
  int32_t push;           // copy `input` into the registered buffer first
  int32_t num_tokens;
  int32_t put_rows;       // partial rows per NVSHMEM put (put path)
  int32_t prep;           // 1: CombinePrep ran (gpu_per_node > 1, or a split call); 0: rows read in place
  // This rank's own rows and weights as the reductions read them: the registered buffer after
  // CombinePrep, else `input` (push) or the registered buffer (pull) and `weights` in place.
  // With one GPU per node no other rank reads or writes them, so a whole (not split) combine
  // needs no staging copy.
  const uint8_t* self_rows;
  const float* self_weights;  // nullable
};

// Offsets of a network dispatch row's fields after the payload.
struct RowLayout {
  int32_t weights, indices, scales, src_pos, stride;
};

MORI_INTER_HD inline RowLayout DispatchRowLayout(int row_bytes, int topk, int scale_bytes) {
  RowLayout r{};
  r.weights = row_bytes;
  r.indices = r.weights + topk * 4;
  r.scales = r.indices + topk * 4;
  r.src_pos = r.scales + scale_bytes;
  r.stride = (r.src_pos + 4 + 15) / 16 * 16;
  return r;
}

MORI_INTER_HD inline int CombineRowStride(int row_bytes, int topk) { return (row_bytes + topk * 4 + 15) / 16 * 16; }

}  // namespace mori::ep::inter
