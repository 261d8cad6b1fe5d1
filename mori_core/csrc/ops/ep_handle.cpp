#include "ops/ep_handle.hpp"

#include <cstring>
#include <sstream>

#include "common/error.hpp"
#include "shmem/gpu_ext.hpp"
#include "shmem/shmem_state.hpp"

namespace mori::ep {

namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

void Require(bool cond, const std::string& msg) {
  if (!cond) throw InvalidArgument(msg);
}

// Per-launch checks build their message only when they fail: a launch is on
// the host's hot path (a few microseconds in all), string building is not.
#define EP_CHECK_ARG(cond, msg_expr)                    \
  do {                                                  \
    if (!(cond)) throw ::mori::InvalidArgument(msg_expr); \
  } while (0)

// Offsets of the op's buffers inside its heap block.
struct Layout {
  size_t total = 0;
  std::map<std::string, std::pair<size_t, size_t>> parts;  // name -> (offset, bytes)
  void Add(const std::string& name, size_t bytes) {
    total = AlignUp(total, kAlign);
    parts[name] = {total, bytes};
    total += bytes;
  }
  size_t Off(const std::string& name) const { return parts.at(name).first; }
};

Layout MakeLayout(const EpHandleConfig& c, size_t row_cap) {
  const size_t recv = c.max_num_tokens_to_recv, tok = c.max_num_inp_token_per_rank, k = c.num_experts_per_token;
  const size_t scale_bytes = static_cast<size_t>(c.scale_dim) * c.scale_type_size;
  Layout l;
  l.Add("dispatch_out", recv * row_cap);
  l.Add("dispatch_out_weights", recv * k * 4);
  l.Add("dispatch_out_indices", recv * k * 4);
  l.Add("dispatch_out_scales", recv * scale_bytes);
  l.Add("src_pos", recv * 4);
  l.Add("combine_input", recv * row_cap);
  l.Add("combine_input_weights", recv * k * 4);
  l.Add("stage", static_cast<size_t>(c.world_size) * tok * row_cap);
  l.Add("stage_weights", static_cast<size_t>(c.world_size) * tok * k * 4);
  l.Add("recv_counter", 2 * sizeof(int32_t));
  l.Add("dispatch_flags", kMaxWorld * sizeof(uint32_t));
  l.Add("combine_flags", kMaxWorld * sizeof(uint32_t));
  l.Add("combine_out", tok * row_cap);
  l.Add("combine_out_weights", tok * k * 4);
  l.Add("dest_slot", tok * c.world_size * 4);
  l.Add("token_mask", tok * 4);
  l.Add("sync", sizeof(EpSyncState));
  l.total = AlignUp(l.total, kAlign);
  return l;
}

const char* PhaseName(int phase) { return phase == kPhaseDispatch ? "dispatch" : "combine"; }

}  // namespace

EpHandle::EpHandle(const EpHandleConfig& c) : cfg_(c) {
  Require(c.world_size >= 1 && c.world_size <= kMaxWorld,
          "world_size must be in [1, " + std::to_string(kMaxWorld) + "], got " + std::to_string(c.world_size));
  Require(c.rank >= 0 && c.rank < c.world_size, "rank out of range");
  Require(c.hidden_dim > 0 && c.max_num_inp_token_per_rank > 0 && c.num_experts_per_rank > 0,
          "hidden_dim, max_num_inp_token_per_rank and num_experts_per_rank must be positive");
  Require(c.num_experts_per_token >= 1 && c.num_experts_per_token <= KernelWarpSize(),
          "num_experts_per_token must be in [1, " + std::to_string(KernelWarpSize()) + "]");
  Require(c.max_token_type_size == 1 || c.max_token_type_size == 2 || c.max_token_type_size == 4,
          "max_token_type_size must be 1, 2 or 4");
  Require(c.max_num_tokens_to_recv >= 1, "max_num_tokens_to_recv must be >= 1");
  Require(static_cast<int64_t>(c.world_size) * c.max_num_inp_token_per_rank < (int64_t{1} << 30),
          "world_size * max_num_inp_token_per_rank must stay below 2^30 (int32 flat source indices)");
  Require(c.timeout_ms > 0, "timeout_ms must be positive");

  shmem::SymmetricHeap& heap = shmem::Heap();
  Require(heap.world_size() == c.world_size && heap.rank() == c.rank,
          "config rank/world_size (" + std::to_string(c.rank) + "/" + std::to_string(c.world_size) +
              ") differ from shmem's (" + std::to_string(heap.rank()) + "/" + std::to_string(heap.world_size()) + ")");
  device_ = heap.device();
  generation_ = shmem::Generation();
  DeviceGuard guard(device_);
  MORI_GPU_CHECK(gpuDeviceGetAttribute(&sm_count_, gpuDevAttrMultiProcessorCount, device_));
  MORI_GPU_CHECK(gpuDeviceGetAttribute(&arch_major_, gpuDevAttrComputeCapabilityMajor, device_));

  row_cap_ = c.hidden_dim * c.max_token_type_size;
  const Layout layout = MakeLayout(c, row_cap_);
  block_bytes_ = layout.total;
  block_ = static_cast<uint8_t*>(heap.Malloc(block_bytes_, 4096));
  heap_offset_ = static_cast<uint64_t>(block_ - heap.base());
  MORI_GPU_CHECK(gpuMemset(block_, 0, block_bytes_));

  void* host = nullptr;
  MORI_GPU_CHECK(gpuHostAlloc(&host, sizeof(EpErrorRecord), gpuHostAllocMapped | gpuHostAllocPortable));
  host_error_ = static_cast<EpErrorRecord*>(host);
  std::memset(host_error_, 0, sizeof(EpErrorRecord));
  void* dev_error = nullptr;
  MORI_GPU_CHECK(gpuHostGetDevicePointer(&dev_error, host, 0));

  EpGeometry& g = args_.geo;
  g.rank = c.rank;
  g.world = c.world_size;
  g.topk = c.num_experts_per_token;
  g.experts_per_rank = c.num_experts_per_rank;
  g.num_experts = c.num_experts_per_rank * c.world_size;
  g.max_tok = c.max_num_inp_token_per_rank;
  g.max_recv = c.max_num_tokens_to_recv;
  g.max_send = c.world_size * c.max_num_inp_token_per_rank;
  g.scale_bytes = c.scale_dim * c.scale_type_size;
  g.timeout_ns = static_cast<uint64_t>(c.timeout_ms) * 1000000ull;
  auto at = [&](const char* name) { return block_ + layout.Off(name); };
  EpBuffers& b = args_.buf;
  b.dispatch_out = at("dispatch_out");
  b.dispatch_out_weights = reinterpret_cast<float*>(at("dispatch_out_weights"));
  b.dispatch_out_indices = reinterpret_cast<int32_t*>(at("dispatch_out_indices"));
  b.dispatch_out_scales = at("dispatch_out_scales");
  b.src_pos = reinterpret_cast<int32_t*>(at("src_pos"));
  b.combine_inp = at("combine_input");
  b.combine_inp_weights = reinterpret_cast<float*>(at("combine_input_weights"));
  b.stage = at("stage");
  b.stage_weights = reinterpret_cast<float*>(at("stage_weights"));
  b.recv_counter = reinterpret_cast<int32_t*>(at("recv_counter"));
  b.dispatch_flags = reinterpret_cast<uint32_t*>(at("dispatch_flags"));
  b.combine_flags = reinterpret_cast<uint32_t*>(at("combine_flags"));
  b.combine_out = at("combine_out");
  b.combine_out_weights = reinterpret_cast<float*>(at("combine_out_weights"));
  b.dest_slot = reinterpret_cast<int32_t*>(at("dest_slot"));
  b.token_mask = reinterpret_cast<uint32_t*>(at("token_mask"));
  b.sync = reinterpret_cast<EpSyncState*>(at("sync"));
  b.error = static_cast<EpErrorRecord*>(dev_error);
  for (int pe = 0; pe < kMaxWorld; ++pe)
    args_.peer_delta[pe] = pe < c.world_size ? static_cast<int64_t>(heap.PeerBase(pe) - heap.base()) : 0;
}

EpHandle::~EpHandle() {
  try {
    Close();
  } catch (...) {
  }
}

void EpHandle::Close() {
  if (block_ && shmem::Initialized() && shmem::Generation() == generation_) {
    DeviceGuard guard(device_);
    (void)gpuDeviceSynchronize();
    shmem::Heap().Free(block_);
  }
  block_ = nullptr;
  if (host_error_) {
    (void)gpuFreeHost(host_error_);
    host_error_ = nullptr;
  }
}

void EpHandle::CheckUsable() const {
  if (!block_) throw BadState("the EP operator is closed");
  if (shmem::Generation() != generation_ || !shmem::Initialized())
    throw BadState("mori shmem was finalised after this EP operator was created; recreate the operator");
  if (reinterpret_cast<const volatile EpErrorRecord*>(host_error_)->code != kErrNone) throw OpFailed(ErrorMessage());
}

void EpHandle::CheckWarps(int warps, int max_threads, const char* what) const {
  const int max_warps = max_threads / KernelWarpSize();
  EP_CHECK_ARG(warps >= 1 && warps <= max_warps, std::string(what) + " warp_per_block must be in [1, " +
                                                     std::to_string(max_warps) + "], got " + std::to_string(warps));
}

void EpHandle::set_timeout_ms(int64_t ms) {
  Require(ms > 0, "timeout_ms must be positive");
  cfg_.timeout_ms = ms;
  args_.geo.timeout_ns = static_cast<uint64_t>(ms) * 1000000ull;
}

void EpHandle::Dispatch(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales,
                        uintptr_t indices, int blocks, int warps, uintptr_t stream) {
  CheckUsable();
  EP_CHECK_ARG(num_tokens >= 0 && num_tokens <= cfg_.max_num_inp_token_per_rank,
          "num_tokens must be in [0, max_num_inp_token_per_rank=" + std::to_string(cfg_.max_num_inp_token_per_rank) +
              "], got " + std::to_string(num_tokens));
  EP_CHECK_ARG(row_bytes > 0 && row_bytes % 16 == 0 && row_bytes <= row_cap_,
          "row bytes must be a positive multiple of 16 up to hidden_dim * max_token_type_size = " +
              std::to_string(row_cap_) + ", got " + std::to_string(row_bytes));
  EP_CHECK_ARG(num_tokens == 0 || (input && indices), "input and indices must be non-null");
  EP_CHECK_ARG(input % 16 == 0, "input must be 16-byte aligned");
  EP_CHECK_ARG(blocks >= 1, "block_num must be >= 1, got " + std::to_string(blocks));
  CheckWarps(warps, kDispatchMaxThreads, "dispatch");
  DispatchParams p{};
  p.input = reinterpret_cast<const uint8_t*>(input);
  p.weights = reinterpret_cast<const float*>(weights);
  p.scales = cfg_.scale_dim > 0 ? reinterpret_cast<const uint8_t*>(scales) : nullptr;
  p.indices = reinterpret_cast<const int32_t*>(indices);
  p.num_tokens = num_tokens;
  p.row_bytes = row_bytes;
  DeviceGuard guard(device_);
  LaunchDispatch(args_, p, blocks, warps, reinterpret_cast<gpuStream_t>(stream));
}

void EpHandle::Combine(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights, int weight_rows,
                       bool weights_symmetric, uintptr_t indices, int num_tokens, bool push, int blocks, int warps,
                       uintptr_t stream) {
  CheckUsable();
  EP_CHECK_ARG(dtype == 0 || dtype == 1, "combine dtype code must be 0 (bf16) or 1 (fp32)");
  const int elem = dtype == 0 ? 2 : 4;
  const int row_bytes = hidden_dim * elem;
  EP_CHECK_ARG(hidden_dim > 0 && row_bytes % 16 == 0 && row_bytes <= row_cap_,
          "combine rows must be a positive multiple of 16 bytes up to " + std::to_string(row_cap_) + ", got " +
              std::to_string(row_bytes));
  EP_CHECK_ARG(num_tokens >= 0 && num_tokens <= cfg_.max_num_inp_token_per_rank, "num_tokens out of range");
  EP_CHECK_ARG(num_tokens == 0 || indices, "indices must be non-null");
  EP_CHECK_ARG(!push || input % 16 == 0, "input must be 16-byte aligned");
  EP_CHECK_ARG(blocks >= 1, "block_num must be >= 1, got " + std::to_string(blocks));
  CheckWarps(warps, kCombineMaxThreads, "combine");
  const CombineDtype dt = dtype == 0 ? CombineDtype::kBf16 : CombineDtype::kFp32;
  auto key = std::make_tuple(dtype, push, warps);
  auto it = combine_grid_cap_.find(key);
  if (it == combine_grid_cap_.end())
    it = combine_grid_cap_.emplace(key, CombineMaxCoResidentBlocks(cfg_.world_size, dt, push, warps, device_)).first;
  blocks = std::min(blocks, std::max(1, it->second));
  CombineParams p{};
  p.input = reinterpret_cast<const uint8_t*>(input);
  p.weights = reinterpret_cast<const float*>(weights);
  p.indices = reinterpret_cast<const int32_t*>(indices);
  p.row_bytes = row_bytes;
  p.input_rows = input_rows;
  p.weight_rows = weight_rows;
  p.weights_symmetric = weights_symmetric ? 1 : 0;
  p.num_tokens = num_tokens;
  p.check_input_rows = push ? 1 : 0;
  DeviceGuard guard(device_);
  LaunchCombine(args_, p, dt, push, blocks, warps, reinterpret_cast<gpuStream_t>(stream));
}

std::vector<std::tuple<std::string, uintptr_t, size_t>> EpHandle::Buffers() const {
  if (!block_) throw BadState("the EP operator is closed");
  const Layout l = MakeLayout(cfg_, row_cap_);
  std::vector<std::tuple<std::string, uintptr_t, size_t>> out;
  for (const char* name : {"dispatch_out", "dispatch_out_weights", "dispatch_out_indices", "dispatch_out_scales",
                           "src_pos", "combine_input", "combine_out", "combine_out_weights"}) {
    const auto& [off, bytes] = l.parts.at(name);
    out.emplace_back(name, reinterpret_cast<uintptr_t>(block_ + off), bytes);
  }
  out.emplace_back("total_recv", reinterpret_cast<uintptr_t>(&args_.buf.sync->total_recv), sizeof(int32_t));
  return out;
}

std::string EpHandle::ErrorMessage() const {
  if (!host_error_) return "";
  const volatile EpErrorRecord* e = host_error_;
  const int32_t code = e->code;
  if (code == kErrNone) return "";
  std::ostringstream os;
  const int rank = cfg_.rank;
  const char* phase = PhaseName(e->phase);
  switch (code) {
    case kErrTimeout:
      os << "EP " << phase << " on rank " << rank << " timed out after " << cfg_.timeout_ms
         << " ms waiting for peer rank " << e->peer << " (expected round " << e->a << ", last seen " << e->b
         << "): that rank never reached this " << phase
         << "; is it alive and calling dispatch/combine the same number of times? (timeout: MORI_EP_TIMEOUT_MS)";
      break;
    case kErrSendOverflow:
      os << "EP dispatch on rank " << rank << ": rank " << e->peer << " ran out of receive capacity (slot " << e->a
         << " >= " << e->b << "); rows beyond it were dropped; raise max_total_recv_tokens";
      break;
    case kErrRecvOverflow:
      os << "EP dispatch on rank " << rank << ": " << e->a << " tokens were sent to this rank, capacity is " << e->b
         << "; rows beyond it were dropped and total_recv was clamped; raise max_total_recv_tokens";
      break;
    case kErrCombineRows:
      os << "EP combine on rank " << rank << ": input has " << e->b << " rows but dispatch received " << e->a
         << " tokens; pass at least total_recv rows";
      break;
    case kErrCombineWeightRows:
      os << "EP combine on rank " << rank << ": weights have " << e->b << " rows but dispatch received " << e->a
         << " tokens; pass at least total_recv rows";
      break;
    case kErrRoutingMismatch:
      os << "EP combine on rank " << rank << ": indices of token " << e->a << " route to rank mask 0x" << std::hex
         << (static_cast<uint64_t>(e->b) >> 32) << " but dispatch sent it to 0x" << (static_cast<uint64_t>(e->b) & 0xffffffffu)
         << std::dec << "; pass this rank's own routing indices from dispatch";
      break;
    default:
      os << "EP kernel on rank " << rank << " reported error code " << code;
  }
  os << " [the operator is now unusable; recreate it on every rank]";
  return os.str();
}

}  // namespace mori::ep
