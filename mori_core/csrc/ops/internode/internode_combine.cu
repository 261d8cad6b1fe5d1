// Inter-node combine, three launches:
//
// CombinePrep: push mode copies the expert outputs (dispatch-output order) into
//   this rank's registered buffer; the weights rows are staged beside them.
//   The last block tells every node peer that the buffer is ready.
// CombineSend (with Prep: AsyncLL's combine_send): for every row this rank
//   forwarded for another node n, the rows of its destination ranks on this
//   node are read over NVLink and summed in fp32 (ascending local rank), rounded
//   once to the combine dtype: one partial row per (token, node) crosses the
//   network, back to the source rank, with one put-with-signal per node.
// CombineRecv (AsyncLL's combine_recv): per own token, the partial of this
//   node (summed the same way from the node peers) and the partials received
//   from the other nodes are summed in fp32 in ascending node order and
//   rounded once. Weights rows are summed the same way, in fp32 throughout.
#include "ops/internode/internode_device.cuh"

namespace mori::ep::inter {
namespace dev {

__device__ __forceinline__ size_t CombRegion(const InterGeometry& g, int par, int node) {
  return (static_cast<size_t>(par) * g.nodes + node) * g.max_tok * g.comb_stride_cap;
}

__global__ void __launch_bounds__(kMaxThreads) CombinePrepKernel(InterArgs a, InterCombineParams p) {
  __shared__ int s_flag;
  const InterGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const uint32_t round = st->combine_epoch + 1;
  int total = st->total_recv;
  if (p.push && total > p.input_rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      ReportError(a, kErrCombineRows, kPhaseCombineSend, -1, total, p.input_rows);
    total = 0;
  }
  const bool use_w = p.weights != nullptr;
  if (use_w && total > p.weight_rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      ReportError(a, kErrCombineWeightRows, kPhaseCombineSend, -1, total, p.weight_rows);
    total = 0;
  }
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
}

// Waits until every node peer's registered buffer holds this round's rows.
__device__ __forceinline__ bool WaitNodePeers(const InterArgs& a, uint32_t round, int phase) {
  bool ok = true;
  if (static_cast<int>(threadIdx.x) < a.geo.gpn)
    ok = WaitRound(a, a.buf.combine_flags + threadIdx.x, round, phase, a.geo.node * a.geo.gpn + threadIdx.x);
  return __syncthreads_and(ok);
}

// fp32 sum over node peers (ascending) of their registered rows at slot[l],
// 16-byte vector v, rounded once to the dtype (a node's partial row).
template <typename Tag>
__device__ __forceinline__ int4 NodePartial(const InterArgs& a, const int32_t (&slot)[kMaxLocal], int row_bytes,
                                            int v) {
  using VT = VecTraits<Tag>;
  float acc[VT::kElems];
#pragma unroll
  for (int e = 0; e < VT::kElems; ++e) acc[e] = 0.f;
#pragma unroll
  for (int l = 0; l < kMaxLocal; ++l) {
    if (slot[l] < 0) continue;
    const int4* src =
        reinterpret_cast<const int4*>(Peer(a, a.buf.combine_inp, l) + static_cast<size_t>(slot[l]) * row_bytes);
    VT::Accumulate(acc, LoadPeer(src + v));
  }
  return VT::Pack(acc);
}

__device__ __forceinline__ float NodeWeight(const InterArgs& a, const int32_t (&slot)[kMaxLocal], int k) {
  float w = 0.f;
#pragma unroll
  for (int l = 0; l < kMaxLocal; ++l)
    if (slot[l] >= 0) w += Peer(a, a.buf.combine_inp_weights, l)[static_cast<size_t>(slot[l]) * a.geo.topk + k];
  return w;
}

template <typename Tag>
__global__ void __launch_bounds__(kMaxThreads) CombineSendKernel(InterArgs a, InterCombineParams p) {
  __shared__ int32_t s_off[kMaxWorld + 1];
  __shared__ int s_flag;
  const InterGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const auto [round, par] = NextRound(st->combine_epoch);
  if (!WaitNodePeers(a, round, kPhaseCombineSend)) return;
  const int lane = mori::ep::dev::LaneId(), nwarps = blockDim.x / kWarpSize;
  const int gwarp = blockIdx.x * nwarps + threadIdx.x / kWarpSize, total_warps = gridDim.x * nwarps;
  const int vecs = p.row_bytes / 16;
  const bool use_w = p.weights != nullptr;
  if (threadIdx.x == 0) {
    int run = 0;
    for (int m = 0; m < g.nodes; ++m) {
      s_off[m] = run;
      run += m == g.node ? 0 : a.buf.recv_rows[m];
    }
    s_off[g.nodes] = run;
  }
  __syncthreads();
  const int items = s_off[g.nodes];
  const Split sp(items, total_warps, vecs);
  for (int item = gwarp; item < sp.items; item += total_warps) {
    const int it = item % items, part = item / items;
    int m = 0;
    while (m + 1 < g.nodes && s_off[m + 1] <= it) ++m;
    const int j = it - s_off[m];
    int32_t slot[kMaxLocal];
#pragma unroll
    for (int l = 0; l < kMaxLocal; ++l)
      slot[l] = l < g.gpn ? a.buf.fwd_slot[(static_cast<size_t>(m) * g.max_tok + j) * g.gpn + l] : -1;
    uint8_t* row = a.buf.net_comb_send + CombRegion(g, par, m) + static_cast<size_t>(j) * p.stride;
    const int v0 = part * sp.vpp, v1 = min(vecs, v0 + sp.vpp);
    for (int v = v0 + lane; v < v1; v += kWarpSize)
      Store16(reinterpret_cast<int4*>(row) + v, NodePartial<Tag>(a, slot, p.row_bytes, v));
    if (part == 0 && use_w && lane < g.topk) reinterpret_cast<float*>(row + p.row_bytes)[lane] = NodeWeight(a, slot, lane);
  }

  // The last block returns every node's partial rows to their source rank.
  if (!ArriveLast(&a.buf.arrive[kArriveCombineSend], &s_flag)) return;
  const int warp = threadIdx.x / kWarpSize;
  for (int m = warp; m < g.nodes; m += nwarps) {
    if (m == g.node) continue;
    PutRowsWithSignal(a.buf.net_comb_recv + CombRegion(g, par, g.node), a.buf.net_comb_send + CombRegion(g, par, m),
                      a.buf.recv_rows[m], p.stride, a.buf.net_comb_sig + par * g.nodes + g.node, round,
                      m * g.gpn + g.local, lane);
  }
}

template <typename Tag>
__global__ void __launch_bounds__(kMaxThreads) CombineRecvKernel(InterArgs a, InterCombineParams p) {
  using VT = VecTraits<Tag>;
  __shared__ int s_flag;
  const InterGeometry& g = a.geo;
  EpSyncState* st = a.buf.sync;
  if (OpFailed(a)) return;
  const auto [round, par] = NextRound(st->combine_epoch);
  bool ok = true;
  for (int m = threadIdx.x; m < g.nodes; m += blockDim.x) {
    if (m == g.node) continue;
    const int rows = WaitSignal(a.buf.net_comb_sig + par * g.nodes + m, round, g.timeout_ns, st, a.buf.error,
                                kPhaseCombineRecv, m * g.gpn + g.local);
    if (rows < 0) ok = false;
  }
  if (!__syncthreads_and(ok)) return;
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
    int4* dst = reinterpret_cast<int4*>(a.buf.combine_out + static_cast<size_t>(t) * p.row_bytes);
    const int v0 = part * sp.vpp, v1 = min(vecs, v0 + sp.vpp);
    for (int v = v0 + lane; v < v1; v += kWarpSize) {
      float acc[VT::kElems];
#pragma unroll
      for (int e = 0; e < VT::kElems; ++e) acc[e] = 0.f;
      for (int m = 0; m < g.nodes; ++m) {
        if (m == g.node) {
          if (own_node) VT::Accumulate(acc, NodePartial<Tag>(a, slot, p.row_bytes, v));
          continue;
        }
        const int j = a.buf.node_slot[static_cast<size_t>(t) * g.nodes + m];
        if (j < 0) continue;
        const uint8_t* row = a.buf.net_comb_recv + CombRegion(g, par, m) + static_cast<size_t>(j) * p.stride;
        VT::Accumulate(acc, LoadPeer(reinterpret_cast<const int4*>(row) + v));
      }
      Store16(dst + v, VT::Pack(acc));
    }
    if (part == 0 && use_w && lane < g.topk) {
      float w = own_node ? NodeWeight(a, slot, lane) : 0.f;
      for (int m = 0; m < g.nodes; ++m) {
        if (m == g.node) continue;
        const int j = a.buf.node_slot[static_cast<size_t>(t) * g.nodes + m];
        if (j < 0) continue;
        w += reinterpret_cast<const float*>(a.buf.net_comb_recv + CombRegion(g, par, m) +
                                            static_cast<size_t>(j) * p.stride + p.row_bytes)[lane];
      }
      a.buf.combine_out_weights[static_cast<size_t>(t) * g.topk + lane] = w;
    }
  }
  if (!ArriveLast(&a.buf.arrive[kArriveCombineRecv], &s_flag)) return;
  if (threadIdx.x == 0) st->combine_epoch = round;
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
