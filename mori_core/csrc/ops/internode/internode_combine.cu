// Inter-node combine, two or three launches:
//
// CombinePrep (gpu_per_node > 1, or AsyncLL's split call): push mode copies the
//   expert outputs (dispatch-output order) into this rank's registered buffer;
//   the weights rows are staged beside them. The last block tells every node
//   peer that the buffer is ready. With one GPU per node no other rank reads
//   this rank's rows, so a whole combine reads them in place and skips this.
// CombineSend (with Prep: AsyncLL's combine_send): for every row this rank
//   forwarded for another node n, the rows of its destination ranks on this
//   node are read over NVLink and summed in fp32 (ascending local rank), rounded
//   once to the combine dtype: one partial row per (token, node) goes back to
//   the source rank. Every warp of the grid takes rows: stored straight into a
//   direct peer's receive area (rows cut into slices when there are few), or,
//   for a put peer, computed into local staging in chunks of `put_rows` rows,
//   each chunk put by the warp that computed it. The last block completes the
//   puts and signals every peer node.
// CombineRecv (AsyncLL's combine_recv): per own token, the partial of this
//   node (summed the same way from the node peers) and the partials received
//   from the other nodes are summed in fp32 in ascending node order and
//   rounded once. Weights rows are summed the same way, in fp32 throughout.
#include "ops/internode/internode_device.cuh"

namespace mori::ep::inter {
namespace dev {

constexpr int kSumUnroll = 4;  // 16-byte vectors per lane and step of the reductions

__device__ __forceinline__ size_t CombRegion(const InterGeometry& g, int par, int node) {
  return (static_cast<size_t>(par) * g.nodes + node) * g.max_tok * g.comb_stride_cap;
}

// The combine's row checks (CombinePrep's, or CombineSend's when there is no
// prep): the input and weights must cover every received row. Reports from
// block 0 only; returns the rows to use (0 after an error).
__device__ __forceinline__ int CheckedCombineRows(const InterArgs& a, const InterCombineParams& p, int phase) {
  int total = a.buf.sync->total_recv;
  const bool report = blockIdx.x == 0 && threadIdx.x == 0;
  if (p.push && total > p.input_rows) {
    if (report) ReportError(a, kErrCombineRows, phase, -1, total, p.input_rows);
    return 0;
  }
  if (p.weights != nullptr && total > p.weight_rows) {
    if (report) ReportError(a, kErrCombineWeightRows, phase, -1, total, p.weight_rows);
    return 0;
  }
  return total;
}

__global__ void __launch_bounds__(kMaxThreads) CombinePrepKernel(InterArgs a, InterCombineParams p) {
  __shared__ int s_flag;
  const InterGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const uint32_t round = st->combine_epoch + 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) RecordPhase(a, 1, kTCombPrepStart, round);
  const int total = CheckedCombineRows(a, p, kPhaseCombineSend);
  const bool use_w = p.weights != nullptr;
  const size_t nthreads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p.push) {
    const size_t vecs = static_cast<size_t>(total) * (p.row_bytes / 16);
    const int4* src = reinterpret_cast<const int4*>(p.input);
    int4* dst = reinterpret_cast<int4*>(a.buf.combine_inp);
    for (size_t i = first; i < vecs; i += nthreads) Store16(dst + i, LoadStream(src + i));
  }
  if (use_w && p.weights != a.buf.combine_inp_weights) {
    const size_t nw = static_cast<size_t>(total) * g.topk;
    for (size_t i = first; i < nw; i += nthreads) a.buf.combine_inp_weights[i] = p.weights[i];
  }
  if (!ArriveLast(&a.buf.arrive[kArriveCombinePrep], &s_flag)) return;
  if (static_cast<int>(threadIdx.x) < g.gpn) {
    FenceSys();
    StoreReleaseSys(Peer(a, a.buf.combine_flags + g.local, threadIdx.x), round);
  }
  if (threadIdx.x == 0) RecordPhase(a, 1, kTCombPrepDone, round);
}

// Waits until every node peer's registered buffer holds this round's rows.
__device__ __forceinline__ bool WaitNodePeers(const InterArgs& a, uint32_t round, int phase) {
  bool ok = true;
  if (static_cast<int>(threadIdx.x) < a.geo.gpn)
    ok = WaitRound(a, a.buf.combine_flags + threadIdx.x, round, phase, a.geo.node * a.geo.gpn + threadIdx.x);
  return __syncthreads_and(ok);
}

// Row `slot` of node peer l's rows as the reductions read them (this rank's own in place).
__device__ __forceinline__ const int4* PeerRow(const InterArgs& a, const InterCombineParams& p, int l, int slot) {
  const uint8_t* base = l == a.geo.local ? p.self_rows : Peer(a, a.buf.combine_inp, l);
  return reinterpret_cast<const int4*>(base + static_cast<size_t>(slot) * p.row_bytes);
}

// A node's partial row: vectors v, v + 32, ... (kSumUnroll of them, those < v1)
// of the fp32 sum over node peers (ascending) of their rows at slot[l], each
// rounded once to the dtype.
template <typename Tag>
__device__ __forceinline__ void NodePartial(const InterArgs& a, const InterCombineParams& p,
                                            const int32_t (&slot)[kMaxLocal], int v, int v1, int4 (&out)[kSumUnroll]) {
  using VT = VecTraits<Tag>;
  float acc[kSumUnroll][VT::kElems];
#pragma unroll
  for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
    for (int e = 0; e < VT::kElems; ++e) acc[u][e] = 0.f;
#pragma unroll
  for (int l = 0; l < kMaxLocal; ++l) {
    if (slot[l] < 0) continue;
    const int4* src = PeerRow(a, p, l, slot[l]);
    int4 x[kSumUnroll];
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
      if (v + u * kWarpSize < v1) x[u] = LoadPeer(src + v + u * kWarpSize);
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
      if (v + u * kWarpSize < v1) VT::Accumulate(acc[u], x[u]);
  }
#pragma unroll
  for (int u = 0; u < kSumUnroll; ++u) out[u] = VT::Pack(acc[u]);
}

// Writes vectors [v0, v1) of the node partial at slot[] to `dst`.
template <typename Tag>
__device__ __forceinline__ void StorePartial(const InterArgs& a, const InterCombineParams& p,
                                             const int32_t (&slot)[kMaxLocal], int4* dst, int v0, int v1, int lane) {
  for (int v = v0 + lane; v < v1; v += kWarpSize * kSumUnroll) {
    int4 part[kSumUnroll];
    NodePartial<Tag>(a, p, slot, v, v1, part);
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
      if (v + u * kWarpSize < v1) Store16(dst + v + u * kWarpSize, part[u]);
  }
}

__device__ __forceinline__ float NodeWeight(const InterArgs& a, const InterCombineParams& p,
                                            const int32_t (&slot)[kMaxLocal], int k) {
  float w = 0.f;
#pragma unroll
  for (int l = 0; l < kMaxLocal; ++l) {
    if (slot[l] < 0) continue;
    const float* base = l == a.geo.local ? p.self_weights : Peer(a, a.buf.combine_inp_weights, l);
    w += base[static_cast<size_t>(slot[l]) * a.geo.topk + k];
  }
  return w;
}

// Slots on the node peers of the row this rank forwarded as row j of node m.
__device__ __forceinline__ void ForwardSlots(const InterArgs& a, int m, int j, int32_t (&slot)[kMaxLocal]) {
#pragma unroll
  for (int l = 0; l < kMaxLocal; ++l)
    slot[l] = l < a.geo.gpn ? a.buf.fwd_slot[(static_cast<size_t>(m) * a.geo.max_tok + j) * a.geo.gpn + l] : -1;
}

template <typename Tag>
__global__ void __launch_bounds__(kMaxThreads) CombineSendKernel(InterArgs a, InterCombineParams p) {
  __shared__ int32_t s_rows[kMaxWorld];
  __shared__ int32_t s_items[kMaxWorld + 1];
  __shared__ int64_t s_delta[kMaxWorld];
  __shared__ int s_flag;
  const InterGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const auto [round, par] = NextRound(st->combine_epoch);
  const int tid = threadIdx.x;
  if (blockIdx.x == 0 && tid == 0) RecordPhase(a, 1, kTCombSendStart, round);
  if (p.prep) {
    if (!WaitNodePeers(a, round, kPhaseCombineSend)) return;
  } else if (CheckedCombineRows(a, p, kPhaseCombineSend) != st->total_recv) {
    return;  // reported by block 0; the op is failed and the peer nodes time out naming this rank
  }
  const int lane = mori::ep::dev::LaneId(), nwarps = blockDim.x / kWarpSize;
  const int gwarp = blockIdx.x * nwarps + tid / kWarpSize, total_warps = gridDim.x * nwarps;
  const int vecs = p.row_bytes / 16, put_rows = max(1, p.put_rows);
  const bool use_w = p.weights != nullptr;
  // First peer node of this rank's sends (SendOrderNode); one order for the whole grid, since
  // the grid's warps share one item space here.
  const int order0 = (g.node + 1) % g.nodes;
  for (int m = tid; m < g.nodes; m += blockDim.x) {
    s_delta[m] = a.buf.net_peer_delta[m];
    s_rows[m] = m == g.node ? 0 : a.buf.recv_rows[m];
  }
  __syncthreads();
  if (tid == 0) {
    if (blockIdx.x == 0) RecordPhase(a, 1, kTCombSendReady, round);
    int run = 0;  // items by position in this rank's send order (the same for every block)
    for (int i = 0; i < g.nodes; ++i) {
      const int m = SendOrderNode(order0, i, g.nodes);
      s_items[i] = run;
      run += s_delta[m] != 0 ? s_rows[m] : (s_rows[m] + put_rows - 1) / put_rows;
    }
    s_items[g.nodes] = run;
  }
  __syncthreads();
  const int items = s_items[g.nodes];
  int parts = 1;
  if (g.put_peers == 0) parts = min(max(1, total_warps / max(items, 1)), max(1, vecs / kWarpSize));
  const int vpp = (vecs + parts - 1) / parts;
  uint8_t* const recv_region = a.buf.net_comb_recv + CombRegion(g, par, g.node);
  for (int w = gwarp; w < items * parts; w += total_warps) {
    const int it = w % items, part = w / items;
    const int pos = NodeOfItem(s_items, g.nodes, it);
    const int m = SendOrderNode(order0, pos, g.nodes);
    const int q = it - s_items[pos];
    const int64_t delta = s_delta[m];
    int32_t slot[kMaxLocal];
    if (delta != 0) {  // direct: the partial row goes straight into the source's receive area
      const int j = q;
      ForwardSlots(a, m, j, slot);
      uint8_t* row = NetPeer(recv_region, delta) + static_cast<size_t>(j) * p.stride;
      const int v0 = part * vpp, v1 = min(vecs, v0 + vpp);
      StorePartial<Tag>(a, p, slot, reinterpret_cast<int4*>(row), v0, v1, lane);
      if (part == 0 && use_w && lane < g.topk)
        reinterpret_cast<float*>(row + p.row_bytes)[lane] = NodeWeight(a, p, slot, lane);
      continue;
    }
    const int j0 = q * put_rows, j1 = min(s_rows[m], j0 + put_rows);
    uint8_t* stage = a.buf.net_comb_send + CombRegion(g, par, m);
    for (int j = j0; j < j1; ++j) {
      ForwardSlots(a, m, j, slot);
      uint8_t* row = stage + static_cast<size_t>(j) * p.stride;
      StorePartial<Tag>(a, p, slot, reinterpret_cast<int4*>(row), 0, vecs, lane);
      if (use_w && lane < g.topk) reinterpret_cast<float*>(row + p.row_bytes)[lane] = NodeWeight(a, p, slot, lane);
    }
    __syncwarp();
    const size_t at = static_cast<size_t>(j0) * p.stride;
    nvshmemx_putmem_nbi_warp(recv_region + at, stage + at, static_cast<size_t>(j1 - j0) * p.stride,
                             m * g.gpn + g.local);
  }

  // The last block completes the puts and signals every peer node.
  if (!ArriveLast(&a.buf.arrive[kArriveCombineSend], &s_flag)) return;
  if (tid == 0) {
    RecordPhase(a, 1, kTCombSendCopied, round);
    if (g.put_peers > 0) nvshmem_quiet();
  }
  __syncthreads();
  for (int m = tid; m < g.nodes; m += blockDim.x)
    if (m != g.node)
      SignalNode(a.buf.net_comb_sig + par * g.nodes + g.node, round, s_rows[m], s_delta[m], m * g.gpn + g.local);
  __syncthreads();
  if (tid == 0) RecordPhase(a, 1, kTCombSendSignalled, round);
}

template <typename Tag>
__global__ void __launch_bounds__(kMaxThreads) CombineRecvKernel(InterArgs a, InterCombineParams p) {
  using VT = VecTraits<Tag>;
  __shared__ int s_flag;
  const InterGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const auto [round, par] = NextRound(st->combine_epoch);
  if (blockIdx.x == 0 && threadIdx.x == 0) RecordPhase(a, 1, kTCombRecvStart, round);
  bool ok = true;
  for (int m = threadIdx.x; m < g.nodes; m += blockDim.x) {
    if (m == g.node) continue;
    const int rows = WaitSignal(a.buf.net_comb_sig + par * g.nodes + m, round, g.timeout_ns, st, a.buf.error,
                                kPhaseCombineRecv, m * g.gpn + g.local);
    if (rows < 0) ok = false;
  }
  if (!__syncthreads_and(ok)) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) RecordPhase(a, 1, kTCombRecvArrived, round);
  const int lane = mori::ep::dev::LaneId(), nwarps = blockDim.x / kWarpSize;
  const int gwarp = blockIdx.x * nwarps + threadIdx.x / kWarpSize, total_warps = gridDim.x * nwarps;
  const int vecs = p.row_bytes / 16, n = p.num_tokens;
  const bool use_w = p.weights != nullptr;
  const Split sp(n, total_warps, vecs);
  for (int item = gwarp; item < sp.items; item += total_warps) {
    const int t = item % n, part = item / n;
    const uint64_t routed = RankMask(p.indices + static_cast<size_t>(t) * g.topk, g);
    const uint64_t sent = a.buf.token_mask[t];
    if (routed != sent && part == 0 && lane == 0)
      ReportError(a, kErrRoutingMismatch, kPhaseCombineRecv, -1, t,
                  static_cast<int64_t>(((routed & 0xffffffffull) << 32) | (sent & 0xffffffffull)));
    int32_t slot[kMaxLocal];
#pragma unroll
    for (int l = 0; l < kMaxLocal; ++l)
      slot[l] = l < g.gpn ? a.buf.local_slot[static_cast<size_t>(t) * g.gpn + l] : -1;
    const bool own_node = HitsNode(sent, g.node, g);
    const int32_t* tok_node_slot = a.buf.node_slot + static_cast<size_t>(t) * g.nodes;
    int4* dst = reinterpret_cast<int4*>(a.buf.combine_out + static_cast<size_t>(t) * p.row_bytes);
    const int v0 = part * sp.vpp, v1 = min(vecs, v0 + sp.vpp);
    for (int v = v0 + lane; v < v1; v += kWarpSize * kSumUnroll) {
      float acc[kSumUnroll][VT::kElems];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
        for (int e = 0; e < VT::kElems; ++e) acc[u][e] = 0.f;
      for (int m = 0; m < g.nodes; ++m) {
        int4 x[kSumUnroll];
        if (m == g.node) {
          if (!own_node) continue;
          NodePartial<Tag>(a, p, slot, v, v1, x);
        } else {
          const int j = tok_node_slot[m];
          if (j < 0) continue;
          const int4* row = reinterpret_cast<const int4*>(a.buf.net_comb_recv + CombRegion(g, par, m) +
                                                          static_cast<size_t>(j) * p.stride);
#pragma unroll
          for (int u = 0; u < kSumUnroll; ++u)
            if (v + u * kWarpSize < v1) x[u] = LoadPeer(row + v + u * kWarpSize);
        }
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u)
          if (v + u * kWarpSize < v1) VT::Accumulate(acc[u], x[u]);
      }
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
        if (v + u * kWarpSize < v1) Store16(dst + v + u * kWarpSize, VT::Pack(acc[u]));
    }
    if (part == 0 && use_w && lane < g.topk) {
      float w = own_node ? NodeWeight(a, p, slot, lane) : 0.f;
      for (int m = 0; m < g.nodes; ++m) {
        if (m == g.node) continue;
        const int j = tok_node_slot[m];
        if (j < 0) continue;
        w += reinterpret_cast<const float*>(a.buf.net_comb_recv + CombRegion(g, par, m) +
                                            static_cast<size_t>(j) * p.stride + p.row_bytes)[lane];
      }
      a.buf.combine_out_weights[static_cast<size_t>(t) * g.topk + lane] = w;
    }
  }
  if (!ArriveLast(&a.buf.arrive[kArriveCombineRecv], &s_flag)) return;
  if (threadIdx.x == 0) {
    RecordPhase(a, 1, kTCombRecvDone, round);
    st->combine_epoch = round;
  }
}

}  // namespace dev

void LaunchCombinePrep(const InterArgs& args, const InterCombineParams& params, int blocks, int warps,
                       cudaStream_t stream) {
  LaunchKernel(dev::CombinePrepKernel, args, params, blocks, warps, stream);
}

void LaunchCombineSend(const InterArgs& args, const InterCombineParams& params, int dtype, int blocks, int warps,
                       cudaStream_t stream) {
  LaunchKernel(dtype == 0 ? dev::CombineSendKernel<dev::Bf16Tag> : dev::CombineSendKernel<float>, args, params, blocks,
               warps, stream);
}

void LaunchCombineRecv(const InterArgs& args, const InterCombineParams& params, int dtype, int blocks, int warps,
                       cudaStream_t stream) {
  LaunchKernel(dtype == 0 ? dev::CombineRecvKernel<dev::Bf16Tag> : dev::CombineRecvKernel<float>, args, params, blocks,
               warps, stream);
}

}  // namespace mori::ep::inter
