// Inter-node dispatch, two launches:
//
// DispatchSend (all kernel types; AsyncLL's dispatch_send):
//   per own token: the destination-rank mask; rows for ranks of this node go
//   straight into those ranks' receive buffers over NVLink (IntraNode's slot
//   reservation); for every other node the token hits, the row (payload,
//   weights, ids, scales, source index) is packed ONCE into the staging area of
//   that node. With rdma_blocks > 0 (InterNodeV1/V1LL) blocks [0, rdma_blocks)
//   do the staging and the others the NVLink writes, concurrently. The last
//   block puts each node's staged rows to the same-local-rank GPU of that node
//   with one NVSHMEM put-with-signal (signal = round << 32 | rows).
// DispatchRecv (AsyncLL's dispatch_recv):
//   waits (bounded) for every other node's signal, forwards each received row
//   to its destination ranks on this node over NVLink, then the node barrier:
//   the receive count is final and published as total_recv.
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

struct SendSmem {
  ReserveSmem reserve;
  int32_t slot[kMaxThreads][kMaxLocal];
  int flag;
};

__global__ void __launch_bounds__(kMaxThreads, 1) DispatchSendKernel(InterArgs a, InterDispatchParams p) {
  __shared__ SendSmem sm;
  const InterGeometry& g = a.geo;
  if (OpFailed(a)) return;
  const auto [round, par] = NextRound(a.buf.sync->dispatch_epoch);
  int32_t* counter = a.buf.recv_counter + par;
  const int T = blockDim.x, tid = threadIdx.x, lane = mori::ep::dev::LaneId();
  const int warp = tid / kWarpSize, nwarps = T / kWarpSize;
  const int n = p.num_tokens, vecs = p.row_bytes / 16;
  const RowLayout L = DispatchRowLayout(p.row_bytes, g.topk, g.scale_bytes);

  // Block roles: staging for the network, NVLink writes, or both.
  const bool split = p.rdma_blocks > 0 && p.rdma_blocks < static_cast<int>(gridDim.x) && g.nodes > 1;
  const int bid = blockIdx.x;
  const bool do_net = g.nodes > 1 && (!split || bid < p.rdma_blocks);
  const bool do_local = !split || bid >= p.rdma_blocks;
  const int role_blocks = !split ? gridDim.x : (do_net ? p.rdma_blocks : gridDim.x - p.rdma_blocks);
  const int role_bid = !split || do_net ? bid : bid - p.rdma_blocks;
  const int chunk = (n + role_blocks - 1) / role_blocks;
  const int begin = min(n, role_bid * chunk), end = min(n, begin + chunk);

  for (int r0 = begin; r0 < end; r0 += T) {
    const int cnt = min(T, end - r0);
    uint64_t mask = 0;
    if (tid < cnt) {
      const int t = r0 + tid;
      mask = RankMask(p.indices + static_cast<size_t>(t) * g.topk, g);
      if (do_local) a.buf.token_mask[t] = mask;
      if (do_net) {
        for (int m = 0; m < g.nodes; ++m) {
          int j = -1;
          if (m != g.node && HitsNode(mask, m, g)) j = atomicAdd(&a.buf.net_counter[m], 1);
          a.buf.node_slot[static_cast<size_t>(t) * g.nodes + m] = j;
        }
      }
    }
    if (do_local)
      ReserveRow(a, tid < cnt ? LocalBits(mask, g) : 0u, counter, sm.reserve, tid < cnt, sm.slot[tid], a.buf.local_slot,
                 static_cast<size_t>(r0 + tid) * g.gpn, kPhaseDispatchSend);
    __syncthreads();

    // Copy (token, slice) items: the row is loaded once and stored to every
    // node peer it goes to and to every staging row it needs.
    const Split sp(cnt, nwarps, vecs);
    for (int item = warp; item < sp.items; item += nwarps) {
      const int li = item % cnt, part = item / cnt;
      const size_t t = static_cast<size_t>(r0 + li);
      int4* dst[kMaxLocal];
      bool on[kMaxLocal];
#pragma unroll
      for (int l = 0; l < kMaxLocal; ++l) {
        const int s = do_local && l < g.gpn ? sm.slot[li][l] : -1;
        on[l] = s >= 0;
        dst[l] = reinterpret_cast<int4*>(Peer(a, a.buf.dispatch_out, l) + static_cast<size_t>(max(s, 0)) * p.row_bytes);
      }
      const int4* src = reinterpret_cast<const int4*>(p.input + t * p.row_bytes);
      const int v0 = part * sp.vpp, v1 = min(vecs, v0 + sp.vpp);
      for (int v = v0 + lane; v < v1; v += kWarpSize) {
        const int4 x = LoadStream(src + v);
#pragma unroll
        for (int l = 0; l < kMaxLocal; ++l)
          if (on[l]) Store16(dst[l] + v, x);
        if (do_net) {
          for (int m = 0; m < g.nodes; ++m) {
            const int j = a.buf.node_slot[t * g.nodes + m];
            if (j >= 0)
              Store16(reinterpret_cast<int4*>(a.buf.net_send + NetRegion(g, par, m, g.disp_stride_cap) +
                                              static_cast<size_t>(j) * p.stride) + v, x);
          }
        }
      }
      if (part != 0) continue;
      const float* w = p.weights ? p.weights + t * g.topk : nullptr;
      const int32_t* ids = p.indices + t * g.topk;
      const uint8_t* sc = p.scales ? p.scales + t * g.scale_bytes : nullptr;
      const int32_t pos = g.rank * g.max_send + static_cast<int32_t>(t);
#pragma unroll
      for (int l = 0; l < kMaxLocal; ++l)
        if (on[l]) WriteMeta(a, l, sm.slot[li][l], w, ids, sc, pos, lane);
      if (do_net) {
        for (int m = 0; m < g.nodes; ++m) {
          const int j = a.buf.node_slot[t * g.nodes + m];
          if (j < 0) continue;
          uint8_t* row = a.buf.net_send + NetRegion(g, par, m, g.disp_stride_cap) + static_cast<size_t>(j) * p.stride;
          if (lane < g.topk) {
            reinterpret_cast<float*>(row + L.weights)[lane] = w ? w[lane] : 0.f;
            reinterpret_cast<int32_t*>(row + L.indices)[lane] = ids[lane];
          }
          if (sc) CopySmall(row + L.scales, sc, g.scale_bytes, lane);
          if (lane == 0) *reinterpret_cast<int32_t*>(row + L.src_pos) = pos;
        }
      }
    }
    __syncthreads();
  }

  // The last block ships every node's staged rows with one put-with-signal.
  if (!ArriveLast(&a.buf.arrive[kArriveDispatchSend], &sm.flag)) return;
  for (int m = warp; m < g.nodes; m += nwarps) {
    if (m == g.node) continue;
    const int rows = *reinterpret_cast<volatile int32_t*>(&a.buf.net_counter[m]);
    PutRowsWithSignal(a.buf.net_recv + NetRegion(g, par, g.node, g.disp_stride_cap),
                      a.buf.net_send + NetRegion(g, par, m, g.disp_stride_cap), rows, p.stride,
                      a.buf.net_disp_sig + par * g.nodes + g.node, round, m * g.gpn + g.local, lane);
    __syncwarp();
    if (lane == 0) a.buf.net_counter[m] = 0;
  }
  if (tid == 0) a.buf.sync->dispatch_tokens = n;
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
      while (src_node + 1 < g.nodes && sm.off[src_node + 1] <= it) ++src_node;
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
      int m = 0;
      while (m + 1 < g.nodes && sm.off[m + 1] <= it) ++m;
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
      for (int v = v0 + lane; v < v1; v += kWarpSize) {
        const int4 x = LoadPeer(reinterpret_cast<const int4*>(row) + v);
#pragma unroll
        for (int l = 0; l < kMaxLocal; ++l)
          if (on[l]) Store16(dst[l] + v, x);
      }
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
