#include "ops/internode/internode_handle.hpp"

#include <cstring>
#include <map>

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "ops/ep_error_text.hpp"
#include "ops/internode/internode_kernels.hpp"
#include "ops/internode/nvshmem_runtime.hpp"

namespace mori::ep::inter {

namespace {

constexpr size_t kAlign = 256;
size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

void Require(bool cond, const std::string& msg) {
  if (!cond) throw InvalidArgument(msg);
}

struct Layout {
  size_t total = 0;
  std::map<std::string, std::pair<size_t, size_t>> parts;
  void Add(const std::string& name, size_t bytes) {
    total = AlignUp(total, kAlign);
    parts[name] = {total, bytes};
    total += bytes;
  }
  size_t Off(const std::string& name) const { return parts.at(name).first; }
};

int Nodes(const InterHandleConfig& c) { return c.world_size / c.gpu_per_node; }
int RowCap(const InterHandleConfig& c) { return c.hidden_dim * c.max_token_type_size; }

Layout IpcLayout(const InterHandleConfig& c) {
  const size_t recv = c.max_num_tokens_to_recv, tok = c.max_num_inp_token_per_rank, k = c.num_experts_per_token;
  const size_t row = RowCap(c), scale = static_cast<size_t>(c.scale_dim) * c.scale_type_size;
  const size_t nodes = Nodes(c), gpn = c.gpu_per_node;
  Layout l;
  // symmetric part: node peers address these at the same offsets
  l.Add("dispatch_out", recv * row);
  l.Add("dispatch_out_weights", recv * k * 4);
  l.Add("dispatch_out_indices", recv * k * 4);
  l.Add("dispatch_out_scales", recv * scale);
  l.Add("src_pos", recv * 4);
  l.Add("combine_input", recv * row);
  l.Add("combine_input_weights", recv * k * 4);
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
  l.Add("recv_rows", nodes * 4);
  l.Add("token_mask", tok * 8);
  l.Add("arrive", kArriveSlots * 4);
  l.Add("sync", sizeof(EpSyncState));
  l.total = AlignUp(l.total, kAlign);
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
  l.total = AlignUp(l.total, kAlign);
  return l;
}

const char* PhaseName(int phase) {
  switch (phase) {
    case kPhaseDispatchSend: return "dispatch (send)";
    case kPhaseDispatchRecv: return "dispatch (receive)";
    case kPhaseCombineSend: return "combine (send)";
    case kPhaseCombineRecv: return "combine (receive)";
    default: return "EP kernel";
  }
}

}  // namespace

size_t InterNodeHandle::IpcBytes(const InterHandleConfig& c) { return IpcLayout(c).total; }

InterNodeHandle::InterNodeHandle(const InterHandleConfig& c, uintptr_t ipc_block,
                                 const std::vector<int64_t>& local_peer_delta, int device)
    : cfg_(c), device_(device) {
  Require(c.world_size >= 1 && c.world_size <= kMaxWorld,
          "world_size must be in [1, " + std::to_string(kMaxWorld) + "] for the inter-node kernels, got " +
              std::to_string(c.world_size));
  Require(c.gpu_per_node >= 1 && c.gpu_per_node <= kMaxLocal && c.world_size % c.gpu_per_node == 0,
          "gpu_per_node must be in [1, " + std::to_string(kMaxLocal) + "] and divide world_size=" +
              std::to_string(c.world_size) + ", got " + std::to_string(c.gpu_per_node));
  Require(c.rank >= 0 && c.rank < c.world_size, "rank out of range");
  Require(c.hidden_dim > 0 && c.max_num_inp_token_per_rank > 0 && c.num_experts_per_rank > 0,
          "hidden_dim, max_num_inp_token_per_rank and num_experts_per_rank must be positive");
  Require(c.num_experts_per_token >= 1 && c.num_experts_per_token <= 32, "num_experts_per_token must be in [1, 32]");
  Require(c.max_num_tokens_to_recv >= 1, "max_num_tokens_to_recv must be >= 1");
  Require(static_cast<int64_t>(c.world_size) * c.max_num_inp_token_per_rank < (int64_t{1} << 30),
          "world_size * max_num_inp_token_per_rank must stay below 2^30 (int32 flat source indices)");
  Require(c.timeout_ms > 0, "timeout_ms must be positive");
  Require(static_cast<int>(local_peer_delta.size()) == c.gpu_per_node,
          "local_peer_delta must have gpu_per_node entries");
  Require(ipc_block != 0 && ipc_block % 256 == 0, "the node-local block must be a 256-byte aligned heap address");
  const int nodes = Nodes(c);
  if (nodes > 1 && !net::Initialized())
    throw BadState("the inter-node kernels need NVSHMEM initialised (mori_core.ops.internode does it)");
  DeviceGuard guard(device_);
  row_cap_ = RowCap(c);
  ipc_ = reinterpret_cast<uint8_t*>(ipc_block);
  const Layout il = IpcLayout(c);
  MORI_GPU_CHECK(cudaMemset(ipc_, 0, il.total));
  Layout nl;
  if (nodes > 1) {
    nl = NetLayout(c);
    net_ = static_cast<uint8_t*>(net::Malloc(nl.total));
  }
  void* host = nullptr;
  MORI_GPU_CHECK(cudaHostAlloc(&host, sizeof(EpErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  host_error_ = static_cast<EpErrorRecord*>(host);
  std::memset(host_error_, 0, sizeof(EpErrorRecord));
  void* dev_error = nullptr;
  MORI_GPU_CHECK(cudaHostGetDevicePointer(&dev_error, host, 0));
  MORI_GPU_CHECK(cudaDeviceSynchronize());

  InterGeometry& g = args_.geo;
  g.rank = c.rank;
  g.world = c.world_size;
  g.gpn = c.gpu_per_node;
  g.nodes = nodes;
  g.node = c.rank / c.gpu_per_node;
  g.local = c.rank % c.gpu_per_node;
  g.topk = c.num_experts_per_token;
  g.experts_per_rank = c.num_experts_per_rank;
  g.num_experts = c.num_experts_per_rank * c.world_size;
  g.max_tok = c.max_num_inp_token_per_rank;
  g.max_recv = c.max_num_tokens_to_recv;
  g.max_send = c.world_size * c.max_num_inp_token_per_rank;
  g.scale_bytes = c.scale_dim * c.scale_type_size;
  g.disp_stride_cap = DispStrideCap(c);
  g.comb_stride_cap = CombStrideCap(c);
  g.timeout_ns = static_cast<uint64_t>(c.timeout_ms) * 1000000ull;
  auto at = [&](const char* name) { return ipc_ + il.Off(name); };
  auto net_at = [&](const char* name) { return net_ ? net_ + nl.Off(name) : nullptr; };
  InterBuffers& b = args_.buf;
  b.dispatch_out = at("dispatch_out");
  b.dispatch_out_weights = reinterpret_cast<float*>(at("dispatch_out_weights"));
  b.dispatch_out_indices = reinterpret_cast<int32_t*>(at("dispatch_out_indices"));
  b.dispatch_out_scales = at("dispatch_out_scales");
  b.src_pos = reinterpret_cast<int32_t*>(at("src_pos"));
  b.combine_inp = at("combine_input");
  b.combine_inp_weights = reinterpret_cast<float*>(at("combine_input_weights"));
  b.recv_counter = reinterpret_cast<int32_t*>(at("recv_counter"));
  b.dispatch_flags = reinterpret_cast<uint32_t*>(at("dispatch_flags"));
  b.combine_flags = reinterpret_cast<uint32_t*>(at("combine_flags"));
  b.net_send = net_at("net_send");
  b.net_recv = net_at("net_recv");
  b.net_disp_sig = reinterpret_cast<uint64_t*>(net_at("net_disp_sig"));
  b.net_comb_send = net_at("net_comb_send");
  b.net_comb_recv = net_at("net_comb_recv");
  b.net_comb_sig = reinterpret_cast<uint64_t*>(net_at("net_comb_sig"));
  b.combine_out = at("combine_out");
  b.combine_out_weights = reinterpret_cast<float*>(at("combine_out_weights"));
  b.local_slot = reinterpret_cast<int32_t*>(at("local_slot"));
  b.node_slot = reinterpret_cast<int32_t*>(at("node_slot"));
  b.fwd_slot = reinterpret_cast<int32_t*>(at("fwd_slot"));
  b.net_counter = reinterpret_cast<int32_t*>(at("net_counter"));
  b.recv_rows = reinterpret_cast<int32_t*>(at("recv_rows"));
  b.token_mask = reinterpret_cast<uint64_t*>(at("token_mask"));
  b.arrive = reinterpret_cast<uint32_t*>(at("arrive"));
  b.sync = reinterpret_cast<EpSyncState*>(at("sync"));
  b.error = static_cast<EpErrorRecord*>(dev_error);
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
  if (host_error_) {
    (void)cudaFreeHost(host_error_);
    host_error_ = nullptr;
  }
}

void InterNodeHandle::CheckOpen() const {
  if (!ipc_) throw BadState("the EP operator is closed");
}

void InterNodeHandle::CheckGrid(int blocks, int warps) const {
  Require(blocks >= 1, "block_num must be >= 1, got " + std::to_string(blocks));
  Require(warps >= 1 && warps <= kMaxThreads / 32,
          "warp_per_block must be in [1, " + std::to_string(kMaxThreads / 32) + "], got " + std::to_string(warps));
}

void InterNodeHandle::set_timeout_ms(int64_t ms) {
  Require(ms > 0, "timeout_ms must be positive");
  cfg_.timeout_ms = ms;
  args_.geo.timeout_ns = static_cast<uint64_t>(ms) * 1000000ull;
}

void InterNodeHandle::DispatchSend(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights,
                                   uintptr_t scales, uintptr_t indices, int blocks, int warps, int rdma_blocks,
                                   uintptr_t stream) {
  CheckOpen();
  Require(num_tokens >= 0 && num_tokens <= cfg_.max_num_inp_token_per_rank,
          "num_tokens must be in [0, max_num_inp_token_per_rank=" + std::to_string(cfg_.max_num_inp_token_per_rank) +
              "], got " + std::to_string(num_tokens));
  Require(row_bytes > 0 && row_bytes % 16 == 0 && row_bytes <= row_cap_,
          "row bytes must be a positive multiple of 16 up to hidden_dim * max_token_type_size = " +
              std::to_string(row_cap_) + ", got " + std::to_string(row_bytes));
  Require(num_tokens == 0 || (input && indices), "input and indices must be non-null");
  Require(input % 16 == 0, "input must be 16-byte aligned");
  Require(rdma_blocks >= 0, "rdma_block_num must be >= 0");
  CheckGrid(blocks, warps);
  Require(!dispatch_pending_, "dispatch_send() was called twice without dispatch_recv()");
  InterDispatchParams& p = dispatch_;
  p = {};
  p.input = reinterpret_cast<const uint8_t*>(input);
  p.weights = reinterpret_cast<const float*>(weights);
  p.scales = cfg_.scale_dim > 0 ? reinterpret_cast<const uint8_t*>(scales) : nullptr;
  p.indices = reinterpret_cast<const int32_t*>(indices);
  p.num_tokens = num_tokens;
  p.row_bytes = row_bytes;
  p.stride = DispatchRowLayout(row_bytes, cfg_.num_experts_per_token, cfg_.scale_dim * cfg_.scale_type_size).stride;
  p.rdma_blocks = rdma_blocks;
  DeviceGuard guard(device_);
  LaunchDispatchSend(args_, p, blocks, warps, reinterpret_cast<cudaStream_t>(stream));
  dispatch_pending_ = true;
}

void InterNodeHandle::DispatchRecv(int blocks, int warps, uintptr_t stream) {
  CheckOpen();
  Require(dispatch_pending_, "dispatch_recv() needs a preceding dispatch_send()");
  CheckGrid(blocks, warps);
  DeviceGuard guard(device_);
  LaunchDispatchRecv(args_, dispatch_, blocks, warps, reinterpret_cast<cudaStream_t>(stream));
  dispatch_pending_ = false;
}

void InterNodeHandle::CombineSend(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights,
                                  int weight_rows, uintptr_t indices, int num_tokens, bool push, int blocks, int warps,
                                  uintptr_t stream) {
  CheckOpen();
  Require(!dispatch_pending_, "combine needs the preceding dispatch_recv()");
  Require(!combine_pending_, "combine_send() was called twice without combine_recv()");
  Require(dtype == 0 || dtype == 1, "combine dtype code must be 0 (bf16) or 1 (fp32)");
  const int row_bytes = hidden_dim * (dtype == 0 ? 2 : 4);
  Require(hidden_dim > 0 && row_bytes % 16 == 0 && row_bytes <= row_cap_,
          "combine rows must be a positive multiple of 16 bytes up to " + std::to_string(row_cap_) + ", got " +
              std::to_string(row_bytes));
  Require(num_tokens >= 0 && num_tokens <= cfg_.max_num_inp_token_per_rank, "num_tokens out of range");
  Require(num_tokens == 0 || indices, "indices must be non-null");
  Require(!push || input % 16 == 0, "input must be 16-byte aligned");
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
  combine_dtype_ = dtype;
  DeviceGuard guard(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  LaunchCombinePrep(args_, p, blocks, warps, s);
  LaunchCombineSend(args_, p, dtype, blocks, warps, s);
  combine_pending_ = true;
}

void InterNodeHandle::CombineRecv(int blocks, int warps, uintptr_t stream) {
  CheckOpen();
  Require(combine_pending_, "combine_recv() needs a preceding combine_send()");
  CheckGrid(blocks, warps);
  DeviceGuard guard(device_);
  LaunchCombineRecv(args_, combine_, combine_dtype_, blocks, warps, reinterpret_cast<cudaStream_t>(stream));
  combine_pending_ = false;
}

std::vector<std::tuple<std::string, uintptr_t, size_t>> InterNodeHandle::Buffers() const {
  CheckOpen();
  const Layout l = IpcLayout(cfg_);
  std::vector<std::tuple<std::string, uintptr_t, size_t>> out;
  for (const char* name : {"dispatch_out", "dispatch_out_weights", "dispatch_out_indices", "dispatch_out_scales",
                           "src_pos", "combine_input", "combine_out", "combine_out_weights"}) {
    const auto& [off, bytes] = l.parts.at(name);
    out.emplace_back(name, reinterpret_cast<uintptr_t>(ipc_ + off), bytes);
  }
  out.emplace_back("total_recv", reinterpret_cast<uintptr_t>(&args_.buf.sync->total_recv), sizeof(int32_t));
  return out;
}

std::string InterNodeHandle::ErrorMessage() const {
  if (!host_error_) return "";
  const EpErrorRecord e = ReadErrorRecord(host_error_);
  if (e.code == kErrNone) return "";
  EpErrorContext c;
  c.rank = cfg_.rank;
  c.timeout_ms = cfg_.timeout_ms;
  c.phase = PhaseName(e.phase);
  c.gpu_per_node = cfg_.gpu_per_node;
  return DescribeEpError(e, c);
}

}  // namespace mori::ep::inter
