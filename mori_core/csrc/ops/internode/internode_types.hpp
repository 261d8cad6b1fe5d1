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

struct InterGeometry {
  int32_t rank, world, gpn, nodes, node, local;
  int32_t topk, experts_per_rank, num_experts;
  int32_t max_tok;      // max_num_inp_token_per_rank
  int32_t max_recv;     // receive capacity of the dispatch outputs
  int32_t max_send;     // world * max_tok: stride of the flat source index
  int32_t scale_bytes;  // bytes of one token's scales (0: none)
  int32_t disp_stride_cap;  // bytes of one network dispatch row at the op's maximum row size
  int32_t comb_stride_cap;  // bytes of one network combine row at the op's maximum row size
  int32_t pad_;
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
  int32_t* net_counter;        // [nodes] staging reservations of the running dispatch
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
