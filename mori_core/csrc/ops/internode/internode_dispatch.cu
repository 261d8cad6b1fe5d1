// Inter-node dispatch, two launches:
//
// DispatchSend (all kernel types; AsyncLL's dispatch_send), per batch of up to
// blockDim own tokens of a block:
//   1. one thread per token builds its destination-rank mask; the block
//      reserves slots on the node peers its tokens go to (IntraNode's scheme,
//      one system-scope atomic per (block, peer)) and network rows for every
//      other node they hit (one atomic per (block, node): the batch's rows for
//      node m are one contiguous range, in token order);
//   2. every warp takes work items: a token's row for the node peers (loaded
//      once, stored to each), and the network rows of each peer node. A direct
//      peer (NVSHMEM heap load/store-reachable) gets the row, with weights, ids,
//      scales and source index, stored straight into its receive area; small
//      batches cut rows into slices so that every warp has work. A put peer
//      gets chunks of `put_rows` rows: the warp stages them locally and issues
//      one nvshmemx_putmem_nbi_warp per chunk at once, so staging and sending
//      overlap across warps and blocks and many puts are in flight.
//   With rdma_blocks > 0 (InterNodeV1/V1LL) blocks [0, rdma_blocks) do the
//   network rows and the others the node peers, concurrently.
//   3. the last block completes the puts (nvshmem_quiet) and signals every
//      peer node (round << 32 | rows): a release store through the mapping for
//      a direct peer, nvshmemx_signal_op for a put peer.
// DispatchRecv (AsyncLL's dispatch_recv):
//   waits (bounded) for every other node's signal, forwards each received row
//   to its destination ranks on this node over NVLink, then the node barrier:
//   the receive count is final and published as total_recv.
//
// The receive area is fixed: node n's rows land in [par][n][row j] of the
// proxy's net_recv, whichever path carried them (the LL layout contract).
#include "ops/internode/internode_device.cuh"

namespace mori::ep::inter {
namespace dev {

__device__ __forceinline__ size_t NetRegion(const InterGeometry& g, int par, int node, int stride_cap) {
  return (static_cast<size_t>(par) * g.nodes + node) * g.max_tok * stride_cap;
}

// Writes one received row (payload from `payload`, metadata from the other
// pointers) into node peer l's receive buffers at `slot`.
__device__ __forceinline__ void WriteMeta(const InterArgs& a, int l, int slot, const float* w, const int32_t* ids,
                                          const uint8_t* scales, int32_t src_pos, int lane) {
  const InterGeometry& g = a.geo;
  const size_t s = static_cast<size_t>(slot);
  if (lane < g.topk) {
    Peer(a, a.buf.dispatch_out_weights, l)[s * g.topk + lane] = w ? w[lane] : 0.f;
    Peer(a, a.buf.dispatch_out_indices, l)[s * g.topk + lane] = ids[lane];
  }
  if (scales) CopySmall(Peer(a, a.buf.dispatch_out_scales, l) + s * g.scale_bytes, scales, g.scale_bytes, lane);
  if (lane == 0) Peer(a, a.buf.src_pos, l)[s] = src_pos;
}

// Writes the metadata of own token t into a network row (local staging or a
// direct peer's receive area): weights, ids, scales, flat source index.
__device__ __forceinline__ void WriteNetMeta(uint8_t* row, const RowLayout& L, const InterArgs& a,
                                             const InterDispatchParams& p, size_t t, int lane) {
  const InterGeometry& g = a.geo;
  if (lane < g.topk) {
    reinterpret_cast<float*>(row + L.weights)[lane] = p.weights ? p.weights[t * g.topk + lane] : 0.f;
    reinterpret_cast<int32_t*>(row + L.indices)[lane] = p.indices[t * g.topk + lane];
  }
  if (p.scales) CopySmall(row + L.scales, p.scales + t * g.scale_bytes, g.scale_bytes, lane);
  if (lane == 0) *reinterpret_cast<int32_t*>(row + L.src_pos) = g.rank * g.max_send + static_cast<int32_t>(t);
}

struct SendSmem {
  ReserveSmem reserve;
  NodeReserveSmem node;
  int32_t slot[kMaxThreads][kMaxLocal];
  int32_t item_off[kMaxWorld + 1];  // work items of each peer node in this batch (prefix)
  int64_t delta[kMaxWorld];         // net_peer_delta, per node
  int flag;
};

constexpr int kCopyUnroll = 4;  // 16-byte vectors in flight per lane

__global__ void __launch_bounds__(kMaxThreads, 1) DispatchSendKernel(InterArgs a, InterDispatchParams p) {
  __shared__ SendSmem sm;
  const InterGeometry& g = a.geo;
  if (OpFailed(a)) return;
  const auto [round, par] = NextRound(a.buf.sync->dispatch_epoch);
  const int T = blockDim.x, tid = threadIdx.x, lane = mori::ep::dev::LaneId();
  const int warp = tid / kWarpSize, nwarps = T / kWarpSize;
  if (blockIdx.x == 0 && tid == 0) RecordPhase(a, 0, kTDispSendStart, round);
  int32_t* counter = a.buf.recv_counter + par;
  const int n = p.num_tokens, vecs = p.row_bytes / 16;
  const RowLayout L = DispatchRowLayout(p.row_bytes, g.topk, g.scale_bytes);
  const int put_rows = max(1, p.put_rows);

  // Block roles: network rows, node-peer rows, or both.
  const bool split = p.rdma_blocks > 0 && p.rdma_blocks < static_cast<int>(gridDim.x) && g.nodes > 1;
  const int bid = blockIdx.x;
  const bool do_net = g.nodes > 1 && (!split || bid < p.rdma_blocks);
  const bool do_local = !split || bid >= p.rdma_blocks;
  const int role_blocks = !split ? gridDim.x : (do_net ? p.rdma_blocks : gridDim.x - p.rdma_blocks);
  const int role_bid = !split || do_net ? bid : bid - p.rdma_blocks;
  const int chunk = (n + role_blocks - 1) / role_blocks;
  const int begin = min(n, role_bid * chunk), end = min(n, begin + chunk);
  for (int m = tid; m < g.nodes; m += T) sm.delta[m] = a.buf.net_peer_delta[m];
  // First peer node of this block's sends: differs per rank, and per block over the peer nodes
  // (SendOrderNode), so the blocks of one rank also spread over every peer at once.
  const int order0 = g.nodes > 1 ? (g.node + 1 + role_bid % (g.nodes - 1)) % g.nodes : 0;
  // Node m's proxy receives this rank's rows in its region for this node.
  uint8_t* const recv_region = do_net ? a.buf.net_recv + NetRegion(g, par, g.node, g.disp_stride_cap) : nullptr;

  for (int r0 = begin; r0 < end; r0 += T) {
    const int cnt = min(T, end - r0);
    const bool has = tid < cnt;
    const int t = r0 + tid;
    const uint64_t mask = has ? RankMask(p.indices + static_cast<size_t>(t) * g.topk, g) : 0;
    if (has && do_local) a.buf.token_mask[t] = mask;
    if (do_net) ReserveNodeRows(a, mask, has, t, sm.node);
    if (do_local)
      ReserveRow(a, has ? LocalBits(mask, g) : 0u, counter, sm.reserve, has, sm.slot[tid], a.buf.local_slot,
                 static_cast<size_t>(t) * g.gpn, kPhaseDispatchSend);
    if (do_net && tid == 0) {  // items by position in this block's send order (own node: no rows)
      int run = 0;
      for (int i = 0; i < g.nodes; ++i) {
        const int m = SendOrderNode(order0, i, g.nodes);
        sm.item_off[i] = run;
        const int rows = sm.node.run[m];
        run += sm.delta[m] != 0 ? rows : (rows + put_rows - 1) / put_rows;
      }
      sm.item_off[g.nodes] = run;
    }
    __syncthreads();

    // Work items: [0, local_items) own tokens for the node peers, then the network items.
    const int local_items = do_local ? cnt : 0;
    const int total = local_items + (do_net ? sm.item_off[g.nodes] : 0);
    int parts = 1;
    if (g.put_peers == 0 || !do_net) parts = min(max(1, nwarps / max(total, 1)), max(1, vecs / kWarpSize));
    const int vpp = (vecs + parts - 1) / parts;
    for (int it = warp; it < total * parts; it += nwarps) {
      const int item = it % total, part = it / total;
      const int v0 = part * vpp, v1 = min(vecs, v0 + vpp);
      if (item < local_items) {
        const int li = item;
        const size_t tt = static_cast<size_t>(r0 + li);
        int4* dst[kMaxLocal];
        bool on[kMaxLocal], any = false;
#pragma unroll
        for (int l = 0; l < kMaxLocal; ++l) {
          const int s = l < g.gpn ? sm.slot[li][l] : -1;
          on[l] = s >= 0;
          any |= on[l];
          dst[l] = reinterpret_cast<int4*>(Peer(a, a.buf.dispatch_out, l) +
                                           static_cast<size_t>(max(s, 0)) * p.row_bytes);
        }
        if (!any) continue;  // the token goes to no rank of this node
        const int4* src = reinterpret_cast<const int4*>(p.input + tt * p.row_bytes);
        CopyVecsToPeers<kCopyUnroll, true>(dst, on, src, v0, v1, lane);
        if (part != 0) continue;
        const float* w = p.weights ? p.weights + tt * g.topk : nullptr;
        const uint8_t* sc = p.scales ? p.scales + tt * g.scale_bytes : nullptr;
        const int32_t pos = g.rank * g.max_send + static_cast<int32_t>(tt);
#pragma unroll
        for (int l = 0; l < kMaxLocal; ++l)
          if (on[l]) WriteMeta(a, l, sm.slot[li][l], w, p.indices + tt * g.topk, sc, pos, lane);
        continue;
      }
      const int ni = item - local_items;
      const int pos = NodeOfItem(sm.item_off, g.nodes, ni);
      const int m = SendOrderNode(order0, pos, g.nodes);
      const int q = ni - sm.item_off[pos];
      const int64_t delta = sm.delta[m];
      const int* row_tok = a.buf.net_row_tok + static_cast<size_t>(m) * g.max_tok;
      if (delta != 0) {  // direct: store into node m's proxy's receive area
        const int j = sm.node.base[m] + q;
        const size_t tt = static_cast<size_t>(row_tok[j]);
        uint8_t* row = NetPeer(recv_region, delta) + static_cast<size_t>(j) * p.stride;
        const int4* src = reinterpret_cast<const int4*>(p.input + tt * p.row_bytes);
        CopyVecs<kCopyUnroll, true>(reinterpret_cast<int4*>(row), src, v0, v1, lane);
        if (part == 0) WriteNetMeta(row, L, a, p, tt, lane);
        continue;
      }
      // put: stage a chunk of rows, then one put of the chunk
      const int j0 = sm.node.base[m] + q * put_rows;
      const int j1 = min(sm.node.base[m] + sm.node.run[m], j0 + put_rows);
      uint8_t* stage = a.buf.net_send + NetRegion(g, par, m, g.disp_stride_cap);
      for (int j = j0; j < j1; ++j) {
        const size_t tt = static_cast<size_t>(row_tok[j]);
        uint8_t* row = stage + static_cast<size_t>(j) * p.stride;
        const int4* src = reinterpret_cast<const int4*>(p.input + tt * p.row_bytes);
        CopyVecs<kCopyUnroll, true>(reinterpret_cast<int4*>(row), src, 0, vecs, lane);
        WriteNetMeta(row, L, a, p, tt, lane);
      }
      __syncwarp();
      const size_t at = static_cast<size_t>(j0) * p.stride;
      nvshmemx_putmem_nbi_warp(recv_region + at, stage + at, static_cast<size_t>(j1 - j0) * p.stride,
                               m * g.gpn + g.local);
    }
    __syncthreads();
  }

  // The last block completes the puts and signals every peer node (with 0 rows too).
  if (!ArriveLast(&a.buf.arrive[kArriveDispatchSend], &sm.flag)) return;
  if (tid == 0) {
    RecordPhase(a, 0, kTDispSendCopied, round);
    if (g.put_peers > 0) nvshmem_quiet();
  }
  __syncthreads();
  for (int m = tid; m < g.nodes; m += T) {
    if (m == g.node) continue;
    const int rows = *reinterpret_cast<volatile int32_t*>(&a.buf.net_counter[m]);
    SignalNode(a.buf.net_disp_sig + par * g.nodes + g.node, round, rows, sm.delta[m], m * g.gpn + g.local);
    a.buf.net_counter[m] = 0;
  }
  __syncthreads();
  if (tid == 0) {
    a.buf.sync->dispatch_tokens = n;
    RecordPhase(a, 0, kTDispSendSignalled, round);
  }
}

struct RecvSmem {
  ReserveSmem reserve;
  int32_t slot[kMaxThreads][kMaxLocal];
  int32_t rows[kMaxWorld];
  int32_t off[kMaxWorld + 1];
  int flag;
};

__global__ void __launch_bounds__(kMaxThreads, 1) DispatchRecvKernel(InterArgs a, InterDispatchParams p) {
  __shared__ RecvSmem sm;
  const InterGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const auto [round, par] = NextRound(st->dispatch_epoch);
  int32_t* counter = a.buf.recv_counter + par;
  const int T = blockDim.x, tid = threadIdx.x, lane = mori::ep::dev::LaneId();
  const int warp = tid / kWarpSize, nwarps = T / kWarpSize;
  const int vecs = p.row_bytes / 16;
  const RowLayout L = DispatchRowLayout(p.row_bytes, g.topk, g.scale_bytes);
  if (blockIdx.x == 0 && tid == 0) RecordPhase(a, 0, kTDispRecvStart, round);

  // Rows from every other node (each sends a signal, with 0 rows too).
  bool ok = true;
  for (int m = tid; m < g.nodes; m += T) {
    int rows = 0;
    if (m != g.node) {
      rows = WaitSignal(a.buf.net_disp_sig + par * g.nodes + m, round, g.timeout_ns, st, a.buf.error,
                        kPhaseDispatchRecv, m * g.gpn + g.local);
      if (rows < 0 || rows > g.max_tok) {
        if (rows > g.max_tok)
          ReportError(a, kErrRecvOverflow, kPhaseDispatchRecv, m * g.gpn + g.local, rows, g.max_tok);
        ok = false;
        rows = 0;
      }
    }
    sm.rows[m] = rows;
  }
  if (!__syncthreads_and(ok)) return;
  if (tid == 0) {
    if (blockIdx.x == 0) RecordPhase(a, 0, kTDispRecvArrived, round);
    int run = 0;
    for (int m = 0; m < g.nodes; ++m) {
      sm.off[m] = run;
      run += sm.rows[m];
    }
    sm.off[g.nodes] = run;
  }
  __syncthreads();
  if (blockIdx.x == 0)
    for (int m = tid; m < g.nodes; m += T) a.buf.recv_rows[m] = sm.rows[m];
  const int items = sm.off[g.nodes];
  const int chunk = (items + gridDim.x - 1) / gridDim.x;
  const int begin = min(items, static_cast<int>(blockIdx.x) * chunk), end = min(items, begin + chunk);

  for (int r0 = begin; r0 < end; r0 += T) {
    const int cnt = min(T, end - r0);
    uint32_t bits = 0;
    int src_node = 0, j = 0;
    if (tid < cnt) {
      const int it = r0 + tid;
      src_node = NodeOfItem(sm.off, g.nodes, it);
      j = it - sm.off[src_node];
      const uint8_t* row =
          a.buf.net_recv + NetRegion(g, par, src_node, g.disp_stride_cap) + static_cast<size_t>(j) * p.stride;
      bits = LocalBits(RankMask(reinterpret_cast<const int32_t*>(row + L.indices), g), g);
    }
    ReserveRow(a, bits, counter, sm.reserve, tid < cnt, sm.slot[tid], a.buf.fwd_slot,
               (static_cast<size_t>(src_node) * g.max_tok + j) * g.gpn, kPhaseDispatchRecv);
    __syncthreads();
    const Split sp(cnt, nwarps, vecs);
    for (int item = warp; item < sp.items; item += nwarps) {
      const int li = item % cnt, part = item / cnt;
      const int it = r0 + li;
      const int m = NodeOfItem(sm.off, g.nodes, it);
      const uint8_t* row =
          a.buf.net_recv + NetRegion(g, par, m, g.disp_stride_cap) + static_cast<size_t>(it - sm.off[m]) * p.stride;
      int4* dst[kMaxLocal];
      bool on[kMaxLocal];
#pragma unroll
      for (int l = 0; l < kMaxLocal; ++l) {
        const int s = l < g.gpn ? sm.slot[li][l] : -1;
        on[l] = s >= 0;
        dst[l] = reinterpret_cast<int4*>(Peer(a, a.buf.dispatch_out, l) + static_cast<size_t>(max(s, 0)) * p.row_bytes);
      }
      const int v0 = part * sp.vpp, v1 = min(vecs, v0 + sp.vpp);
      CopyVecsToPeers<kCopyUnroll, false>(dst, on, reinterpret_cast<const int4*>(row), v0, v1, lane);
      if (part != 0) continue;
      const float* w = reinterpret_cast<const float*>(row + L.weights);
      const int32_t* ids = reinterpret_cast<const int32_t*>(row + L.indices);
      const uint8_t* sc = g.scale_bytes > 0 && p.scales ? row + L.scales : nullptr;
      const int32_t pos = *reinterpret_cast<const int32_t*>(row + L.src_pos);
#pragma unroll
      for (int l = 0; l < kMaxLocal; ++l)
        if (on[l]) WriteMeta(a, l, sm.slot[li][l], w, ids, sc, pos, lane);
    }
    __syncthreads();
  }

  // Node barrier: every node peer finished writing into this rank.
  if (!ArriveLast(&a.buf.arrive[kArriveDispatchRecv], &sm.flag)) return;
  if (tid == 0) RecordPhase(a, 0, kTDispRecvForwarded, round);
  if (tid < g.gpn) {
    FenceSys();
    StoreReleaseSys(Peer(a, a.buf.dispatch_flags + g.local, tid), round);
  }
  ok = true;
  if (tid < g.gpn) ok = WaitRound(a, a.buf.dispatch_flags + tid, round, kPhaseDispatchRecv, g.node * g.gpn + tid);
  if (!__syncthreads_and(ok)) return;
  if (tid == 0) {
    int total = *reinterpret_cast<volatile int32_t*>(counter);
    *counter = 0;
    if (total > g.max_recv) {
      ReportError(a, kErrRecvOverflow, kPhaseDispatchRecv, -1, total, g.max_recv);
      total = g.max_recv;
    }
    st->total_recv = total;
    RecordPhase(a, 0, kTDispRecvDone, round);
    st->dispatch_epoch = round;
  }
}

}  // namespace dev

void LaunchDispatchSend(const InterArgs& args, const InterDispatchParams& params, int blocks, int warps,
                        cudaStream_t stream) {
  LaunchKernel(dev::DispatchSendKernel, args, params, blocks, warps, stream);
}

void LaunchDispatchRecv(const InterArgs& args, const InterDispatchParams& params, int blocks, int warps,
                        cudaStream_t stream) {
  LaunchKernel(dev::DispatchRecvKernel, args, params, blocks, warps, stream);
}

}  // namespace mori::ep::inter
