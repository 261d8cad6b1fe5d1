#include "ops/ep_handle_base.hpp"

#include <cstring>

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "ops/ep_error_text.hpp"

namespace mori::ep {

namespace {
constexpr size_t kAlign = 256;
size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// The message is built only when the check fails.
#define EP_BASE_CHECK(cond, msg_expr)                      \
  do {                                                     \
    if (!(cond)) throw ::mori::InvalidArgument(msg_expr);  \
  } while (0)
}  // namespace

void RequireArg(bool cond, const std::string& msg) {
  if (!cond) throw InvalidArgument(msg);
}

void BufferLayout::Add(const std::string& name, size_t bytes) {
  total = AlignUp(total, kAlign);
  parts[name] = {total, bytes};
  total += bytes;
}

void BufferLayout::Finish() { total = AlignUp(total, kAlign); }

void AddReceiveBuffers(BufferLayout& l, const EpOpConfig& c, size_t row_cap) {
  const size_t recv = c.max_num_tokens_to_recv, k = c.num_experts_per_token;
  const size_t scale_bytes = static_cast<size_t>(c.scale_dim) * c.scale_type_size;
  l.Add("dispatch_out", recv * row_cap);
  l.Add("dispatch_out_weights", recv * k * 4);
  l.Add("dispatch_out_indices", recv * k * 4);
  l.Add("dispatch_out_scales", recv * scale_bytes);
  l.Add("src_pos", recv * 4);
  l.Add("combine_input", recv * row_cap);
  l.Add("combine_input_weights", recv * k * 4);
}

EpHandleBase::EpHandleBase(const EpOpConfig& c, int max_world, int max_topk, const char* family) : cfg_(c) {
  RequireArg(c.world_size >= 1 && c.world_size <= max_world, "world_size must be in [1, " + std::to_string(max_world) +
                                                                 "]" + family + ", got " + std::to_string(c.world_size));
  RequireArg(c.rank >= 0 && c.rank < c.world_size, "rank out of range");
  RequireArg(c.hidden_dim > 0 && c.max_num_inp_token_per_rank > 0 && c.num_experts_per_rank > 0,
             "hidden_dim, max_num_inp_token_per_rank and num_experts_per_rank must be positive");
  RequireArg(c.num_experts_per_token >= 1 && c.num_experts_per_token <= max_topk,
             "num_experts_per_token must be in [1, " + std::to_string(max_topk) + "]");
  RequireArg(c.max_token_type_size == 1 || c.max_token_type_size == 2 || c.max_token_type_size == 4,
             "max_token_type_size must be 1, 2 or 4");
  RequireArg(c.max_num_tokens_to_recv >= 1, "max_num_tokens_to_recv must be >= 1");
  RequireArg(static_cast<int64_t>(c.world_size) * c.max_num_inp_token_per_rank < (int64_t{1} << 30),
             "world_size * max_num_inp_token_per_rank must stay below 2^30 (int32 flat source indices)");
  RequireArg(c.timeout_ms > 0, "timeout_ms must be positive");
  row_cap_ = c.hidden_dim * c.max_token_type_size;
}

void EpHandleBase::CheckDispatchRows(uintptr_t input, int row_bytes, int num_tokens, uintptr_t indices) const {
  EP_BASE_CHECK(num_tokens >= 0 && num_tokens <= cfg_.max_num_inp_token_per_rank,
                "num_tokens must be in [0, max_num_inp_token_per_rank=" +
                    std::to_string(cfg_.max_num_inp_token_per_rank) + "], got " + std::to_string(num_tokens));
  EP_BASE_CHECK(row_bytes > 0 && row_bytes % 16 == 0 && row_bytes <= row_cap_,
                "row bytes must be a positive multiple of 16 up to hidden_dim * max_token_type_size = " +
                    std::to_string(row_cap_) + ", got " + std::to_string(row_bytes));
  EP_BASE_CHECK(num_tokens == 0 || (input && indices), "input and indices must be non-null");
  EP_BASE_CHECK(input % 16 == 0, "input must be 16-byte aligned");
}

int EpHandleBase::CheckCombineRows(int dtype, int hidden_dim, int num_tokens, uintptr_t indices) const {
  EP_BASE_CHECK(dtype == 0 || dtype == 1, "combine dtype code must be 0 (bf16) or 1 (fp32)");
  const int row_bytes = hidden_dim * (dtype == 0 ? 2 : 4);
  EP_BASE_CHECK(hidden_dim > 0 && row_bytes % 16 == 0 && row_bytes <= row_cap_,
                "combine rows must be a positive multiple of 16 bytes up to " + std::to_string(row_cap_) +
                    ", got " + std::to_string(row_bytes));
  EP_BASE_CHECK(num_tokens >= 0 && num_tokens <= cfg_.max_num_inp_token_per_rank, "num_tokens out of range");
  EP_BASE_CHECK(num_tokens == 0 || indices, "indices must be non-null");
  return row_bytes;
}

EpHandleBase::~EpHandleBase() { CloseErrorRecord(); }

EpErrorRecord* EpHandleBase::OpenErrorRecord() {
  void* host = nullptr;
  MORI_GPU_CHECK(gpuHostAlloc(&host, sizeof(EpErrorRecord), gpuHostAllocMapped | gpuHostAllocPortable));
  host_error_ = static_cast<EpErrorRecord*>(host);
  std::memset(host_error_, 0, sizeof(EpErrorRecord));
  void* dev_error = nullptr;
  MORI_GPU_CHECK(gpuHostGetDevicePointer(&dev_error, host, 0));
  return static_cast<EpErrorRecord*>(dev_error);
}

void EpHandleBase::CloseErrorRecord() {
  if (host_error_) {
    (void)gpuFreeHost(host_error_);
    host_error_ = nullptr;
  }
}

void EpHandleBase::BindTimeout(uint64_t* timeout_ns) {
  timeout_ns_ = timeout_ns;
  *timeout_ns_ = static_cast<uint64_t>(cfg_.timeout_ms) * 1000000ull;
}

void EpHandleBase::set_timeout_ms(int64_t ms) {
  RequireArg(ms > 0, "timeout_ms must be positive");
  cfg_.timeout_ms = ms;
  if (timeout_ns_) *timeout_ns_ = static_cast<uint64_t>(ms) * 1000000ull;
}

BufferTable EpHandleBase::OutputBuffers(const BufferLayout& l, const uint8_t* block, const EpSyncState* sync) const {
  BufferTable out;
  for (const char* name : {"dispatch_out", "dispatch_out_weights", "dispatch_out_indices", "dispatch_out_scales",
                           "src_pos", "combine_input", "combine_out", "combine_out_weights"}) {
    const auto& [off, bytes] = l.parts.at(name);
    out.emplace_back(name, reinterpret_cast<uintptr_t>(block + off), bytes);
  }
  out.emplace_back("total_recv", reinterpret_cast<uintptr_t>(&sync->total_recv), sizeof(int32_t));
  return out;
}

std::string EpHandleBase::ErrorMessage() const {
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

}  // namespace mori::ep
