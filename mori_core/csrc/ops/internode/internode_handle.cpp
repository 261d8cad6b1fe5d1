#include "ops/internode/internode_handle.hpp"

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "ops/internode/internode_kernels.hpp"
#include "ops/internode/nvshmem_runtime.hpp"

namespace mori::ep::inter {

namespace {

void Require(bool cond, const std::string& msg) { RequireArg(cond, msg); }

using Layout = BufferLayout;

int Nodes(const InterHandleConfig& c) { return c.world_size / c.gpu_per_node; }
int RowCap(const InterHandleConfig& c) { return c.hidden_dim * c.max_token_type_size; }

Layout IpcLayout(const InterHandleConfig& c) {
  const size_t tok = c.max_num_inp_token_per_rank, k = c.num_experts_per_token;
  const size_t row = RowCap(c);
  const size_t nodes = Nodes(c), gpn = c.gpu_per_node;
  Layout l;
  // symmetric part: node peers address these at the same offsets
  AddReceiveBuffers(l, c, row);
  l.Add("recv_counter", 2 * 4);
  l.Add("dispatch_flags", kMaxLocal * 4);
  l.Add("combine_flags", kMaxLocal * 4);
  // local part
  l.Add("combine_out", tok * row);
  l.Add("combine_out_weights", tok * k * 4);
  l.Add("local_slot", tok * gpn * 4);
  l.Add("node_slot", tok * nodes * 4);
  l.Add("fwd_slot", nodes * tok * gpn * 4);
  l.Add("net_counter", nodes * 4);
  l.Add("net_row_tok", nodes * tok * 4);
  l.Add("net_peer_delta", nodes * 8);
  l.Add("phase_ns", 2 * kPhaseRing * kPhasePoints * 8);
  l.Add("recv_rows", nodes * 4);
  l.Add("token_mask", tok * 8);
  l.Add("arrive", kArriveSlots * 4);
  l.Add("sync", sizeof(EpSyncState));
  l.Finish();
  return l;
}

int DispStrideCap(const InterHandleConfig& c) {
  return DispatchRowLayout(RowCap(c), c.num_experts_per_token, c.scale_dim * c.scale_type_size).stride;
}
int CombStrideCap(const InterHandleConfig& c) { return CombineRowStride(RowCap(c), c.num_experts_per_token); }

Layout NetLayout(const InterHandleConfig& c) {
  const size_t nodes = Nodes(c), tok = c.max_num_inp_token_per_rank;
  Layout l;
  l.Add("net_send", 2 * nodes * tok * DispStrideCap(c));
  l.Add("net_recv", 2 * nodes * tok * DispStrideCap(c));
  l.Add("net_disp_sig", 2 * nodes * 8);
  l.Add("net_comb_send", 2 * nodes * tok * CombStrideCap(c));
  l.Add("net_comb_recv", 2 * nodes * tok * CombStrideCap(c));
  l.Add("net_comb_sig", 2 * nodes * 8);
  l.Finish();
  return l;
}

}  // namespace

const char* InterNodeHandle::PhaseName(int phase) const {
  switch (phase) {
    case kPhaseDispatchSend: return "dispatch (send)";
    case kPhaseDispatchRecv: return "dispatch (receive)";
    case kPhaseCombineSend: return "combine (send)";
    case kPhaseCombineRecv: return "combine (receive)";
    default: return "EP kernel";
  }
}

size_t InterNodeHandle::IpcBytes(const InterHandleConfig& c) { return IpcLayout(c).total; }

InterNodeHandle::InterNodeHandle(const InterHandleConfig& c, uintptr_t ipc_block,
                                 const std::vector<int64_t>& local_peer_delta, int device, bool force_put)
    : EpHandleBase(c, kMaxWorld, 32, " for the inter-node kernels"), device_(device) {
  Require(c.gpu_per_node >= 1 && c.gpu_per_node <= kMaxLocal && c.world_size % c.gpu_per_node == 0,
          "gpu_per_node must be in [1, " + std::to_string(kMaxLocal) + "] and divide world_size=" +
              std::to_string(c.world_size) + ", got " + std::to_string(c.gpu_per_node));
  Require(static_cast<int>(local_peer_delta.size()) == c.gpu_per_node,
          "local_peer_delta must have gpu_per_node entries");
  Require(ipc_block != 0 && ipc_block % 256 == 0, "the node-local block must be a 256-byte aligned heap address");
  const int nodes = Nodes(c);
  if (nodes > 1 && !net::Initialized())
    throw BadState("the inter-node kernels need NVSHMEM initialised (mori_core.ops.internode does it)");
  DeviceGuard guard(device_);
  ipc_ = reinterpret_cast<uint8_t*>(ipc_block);
  const Layout il = IpcLayout(c);
  MORI_GPU_CHECK(cudaMemset(ipc_, 0, il.total));
  Layout nl;
  if (nodes > 1) {
    nl = NetLayout(c);
    net_ = static_cast<uint8_t*>(net::Malloc(nl.total));
  }
  EpErrorRecord* dev_error = OpenErrorRecord();

  // Path per peer node: its proxy's NVSHMEM heap mapped for loads/stores (direct), else puts.
  std::vector<int64_t> net_delta(nodes, 0);
  int put_peers = 0;
  for (int m = 0; m < nodes; ++m) {
    if (m == c.rank / c.gpu_per_node) continue;
    void* peer = force_put ? nullptr : net::PeerPtr(net_, m * c.gpu_per_node + c.rank % c.gpu_per_node);
    net_delta[m] = peer ? reinterpret_cast<int64_t>(peer) - reinterpret_cast<int64_t>(net_) : 0;
    if (net_delta[m] == 0) ++put_peers;
  }
  MORI_GPU_CHECK(
      cudaMemcpy(ipc_ + il.Off("net_peer_delta"), net_delta.data(), nodes * sizeof(int64_t), cudaMemcpyHostToDevice));
  MORI_GPU_CHECK(cudaDeviceSynchronize());

  InterGeometry& g = args_.geo;
  FillCommonGeometry(g, c);
  g.gpn = c.gpu_per_node;
  g.nodes = nodes;
  g.node = c.rank / c.gpu_per_node;
  g.local = c.rank % c.gpu_per_node;
  g.disp_stride_cap = DispStrideCap(c);
  g.comb_stride_cap = CombStrideCap(c);
  g.put_peers = put_peers;
  BindTimeout(&g.timeout_ns);
  auto at = [&](const char* name) { return ipc_ + il.Off(name); };
  auto net_at = [&](const char* name) { return net_ ? net_ + nl.Off(name) : nullptr; };
  InterBuffers& b = args_.buf;
  BindCommonBuffers(b, at, dev_error);
  b.net_send = net_at("net_send");
  b.net_recv = net_at("net_recv");
  b.net_disp_sig = reinterpret_cast<uint64_t*>(net_at("net_disp_sig"));
  b.net_comb_send = net_at("net_comb_send");
  b.net_comb_recv = net_at("net_comb_recv");
  b.net_comb_sig = reinterpret_cast<uint64_t*>(net_at("net_comb_sig"));
  b.local_slot = reinterpret_cast<int32_t*>(at("local_slot"));
  b.node_slot = reinterpret_cast<int32_t*>(at("node_slot"));
  b.fwd_slot = reinterpret_cast<int32_t*>(at("fwd_slot"));
  b.net_counter = reinterpret_cast<int32_t*>(at("net_counter"));
  b.net_row_tok = reinterpret_cast<int32_t*>(at("net_row_tok"));
  b.net_peer_delta = reinterpret_cast<int64_t*>(at("net_peer_delta"));
  b.phase_ns = reinterpret_cast<int64_t*>(at("phase_ns"));
  b.recv_rows = reinterpret_cast<int32_t*>(at("recv_rows"));
  b.token_mask = reinterpret_cast<uint64_t*>(at("token_mask"));
  b.arrive = reinterpret_cast<uint32_t*>(at("arrive"));
  for (int l = 0; l < kMaxLocal; ++l) args_.peer_delta[l] = l < c.gpu_per_node ? local_peer_delta[l] : 0;
}

InterNodeHandle::~InterNodeHandle() {
  try {
    Close();
  } catch (...) {
  }
}

void InterNodeHandle::Close() {
  if (net_) {
    net::Free(net_);  // collective
    net_ = nullptr;
  }
  ipc_ = nullptr;
  CloseErrorRecord();
}

void InterNodeHandle::CheckOpen() const {
  if (!ipc_) throw BadState("the EP operator is closed");
}

void InterNodeHandle::CheckGrid(int blocks, int warps) const {
  // Messages are built only on failure (this is on every launch's host path).
  if (blocks < 1) Require(false, "block_num must be >= 1, got " + std::to_string(blocks));
  if (warps < 1 || warps > kMaxThreads / 32)
    Require(false, "warp_per_block must be in [1, " + std::to_string(kMaxThreads / 32) + "], got " +
                       std::to_string(warps));
}

void InterNodeHandle::set_put_rows(int rows) {
  Require(rows >= 1 && rows <= cfg_.max_num_inp_token_per_rank,
          "put_rows must be in [1, max_num_inp_token_per_rank=" + std::to_string(cfg_.max_num_inp_token_per_rank) +
              "], got " + std::to_string(rows));
  put_rows_ = rows;
}

std::pair<uintptr_t, size_t> InterNodeHandle::PhaseRing() const {
  CheckOpen();
  return {reinterpret_cast<uintptr_t>(args_.buf.phase_ns), 2 * kPhaseRing * kPhasePoints * sizeof(int64_t)};
}

void InterNodeHandle::Dispatch(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales,
                               uintptr_t indices, int blocks, int warps, int rdma_blocks, bool finish,
                               uintptr_t stream) {
  CheckOpen();
  if (Failed()) throw NetOpFailed(ErrorMessage());
  CheckDispatchRows(input, row_bytes, num_tokens, indices);
  if (rdma_blocks < 0) Require(false, "rdma_block_num must be >= 0");
  CheckGrid(blocks, warps);
  if (dispatch_pending_) Require(false, "dispatch_send() was called twice without dispatch_recv()");
  InterDispatchParams& p = dispatch_;
  p = {};
  FillDispatchPointers(p, cfg_, input, row_bytes, num_tokens, weights, scales, indices);
  p.stride = DispatchRowLayout(row_bytes, cfg_.num_experts_per_token, cfg_.scale_dim * cfg_.scale_type_size).stride;
  p.rdma_blocks = rdma_blocks;
  p.put_rows = put_rows_;
  DeviceGuard guard(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  LaunchDispatchSend(args_, p, blocks, warps, s);
  if (finish)
    LaunchDispatchRecv(args_, p, blocks, warps, s);
  else
    dispatch_pending_ = true;
}

void InterNodeHandle::DispatchRecv(int blocks, int warps, uintptr_t stream) {
  CheckOpen();
  if (!dispatch_pending_) Require(false, "dispatch_recv() needs a preceding dispatch_send()");
  CheckGrid(blocks, warps);
  DeviceGuard guard(device_);
  LaunchDispatchRecv(args_, dispatch_, blocks, warps, reinterpret_cast<cudaStream_t>(stream));
  dispatch_pending_ = false;
}

void InterNodeHandle::Combine(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights,
                              int weight_rows, uintptr_t indices, int num_tokens, bool push, int blocks, int warps,
                              bool finish, uintptr_t stream) {
  CheckOpen();
  if (Failed()) throw NetOpFailed(ErrorMessage());
  if (dispatch_pending_) Require(false, "combine needs the preceding dispatch_recv()");
  if (combine_pending_) Require(false, "combine_send() was called twice without combine_recv()");
  const int row_bytes = CheckCombineRows(dtype, hidden_dim, num_tokens, indices);
  if (push && input % 16 != 0) Require(false, "input must be 16-byte aligned");
  CheckGrid(blocks, warps);
  InterCombineParams& p = combine_;
  p = {};
  p.input = reinterpret_cast<const uint8_t*>(input);
  p.weights = reinterpret_cast<const float*>(weights);
  p.indices = reinterpret_cast<const int32_t*>(indices);
  p.row_bytes = row_bytes;
  p.stride = CombineRowStride(row_bytes, cfg_.num_experts_per_token);
  p.input_rows = input_rows;
  p.weight_rows = weight_rows;
  p.push = push ? 1 : 0;
  p.num_tokens = num_tokens;
  p.put_rows = put_rows_;
  // Node peers read this rank's rows only with several GPUs per node: then they are staged into
  // the registered buffers first (CombinePrep). Alone in its node, this rank reads them in place,
  // unless the call is split (AsyncLL's combine_send): the caller may reuse `input` and `weights`
  // before combine_recv, so they are staged then too.
  p.prep = cfg_.gpu_per_node > 1 || !finish ? 1 : 0;
  p.self_rows = p.prep || !push ? args_.buf.combine_inp : p.input;
  p.self_weights = p.prep ? args_.buf.combine_inp_weights : p.weights;
  combine_dtype_ = dtype;
  DeviceGuard guard(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (p.prep) LaunchCombinePrep(args_, p, blocks, warps, s);
  LaunchCombineSend(args_, p, dtype, blocks, warps, s);
  if (finish)
    LaunchCombineRecv(args_, p, dtype, blocks, warps, s);
  else
    combine_pending_ = true;
}

void InterNodeHandle::CombineRecv(int blocks, int warps, uintptr_t stream) {
  CheckOpen();
  if (!combine_pending_) Require(false, "combine_recv() needs a preceding combine_send()");
  CheckGrid(blocks, warps);
  DeviceGuard guard(device_);
  LaunchCombineRecv(args_, combine_, combine_dtype_, blocks, warps, reinterpret_cast<cudaStream_t>(stream));
  combine_pending_ = false;
}

BufferTable InterNodeHandle::Buffers() const {
  CheckOpen();
  return OutputBuffers(IpcLayout(cfg_), ipc_, args_.buf.sync);
}

}  // namespace mori::ep::inter
