// EpHandleBase: what the IntraNode handle (EpHandle) and the inter-node handle
// (inter::InterNodeHandle) share: the operator's config and its checks, the
// byte layout of named buffers inside one block, the host-mapped error record
// the kernels write (and its description), the kernel timeout, and the table
// of output buffers the Python op views.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/ep_types.hpp"

namespace mori::ep {

// One operator's shape (EpDispatchCombineConfig's fields the kernels need).
struct EpOpConfig {
  int rank = 0;
  int world_size = 1;
  int gpu_per_node = 0;  // inter-node kernels: GPUs per node (0: IntraNode, one node)
  int hidden_dim = 0;
  int scale_dim = 0;
  int scale_type_size = 0;
  int max_token_type_size = 4;
  int max_num_inp_token_per_rank = 0;
  int num_experts_per_rank = 0;
  int num_experts_per_token = 0;
  int max_num_tokens_to_recv = 0;
  int64_t timeout_ms = 10000;
};

// Throws InvalidArgument(msg) unless cond.
void RequireArg(bool cond, const std::string& msg);

// Offsets of named buffers inside one block, each 256-byte aligned.
struct BufferLayout {
  size_t total = 0;
  std::map<std::string, std::pair<size_t, size_t>> parts;  // name -> (offset, bytes)
  void Add(const std::string& name, size_t bytes);
  size_t Off(const std::string& name) const { return parts.at(name).first; }
  // Rounds the total up to the alignment (call after the last Add).
  void Finish();
};

// Adds the buffers every EP op's peers write or read, in this order: dispatch
// outputs (rows, weights, indices, scales, source positions) and the
// registered combine input (rows, weights). `row_cap` = bytes of one row.
void AddReceiveBuffers(BufferLayout& l, const EpOpConfig& c, size_t row_cap);

// The geometry fields both kernel families have (EpGeometry, inter::InterGeometry).
template <typename Geometry>
void FillCommonGeometry(Geometry& g, const EpOpConfig& c) {
  g.rank = c.rank;
  g.world = c.world_size;
  g.topk = c.num_experts_per_token;
  g.experts_per_rank = c.num_experts_per_rank;
  g.num_experts = c.num_experts_per_rank * c.world_size;
  g.max_tok = c.max_num_inp_token_per_rank;
  g.max_recv = c.max_num_tokens_to_recv;
  g.max_send = c.world_size * c.max_num_inp_token_per_rank;
  g.scale_bytes = c.scale_dim * c.scale_type_size;
}

// Points the buffer-table fields both families have (EpBuffers, inter::InterBuffers) at
// `at(name)`: the receive buffers of AddReceiveBuffers, the round counters and flags, the
// combine outputs, the sync state, and the error record's device alias.
template <typename Buffers, typename At>
void BindCommonBuffers(Buffers& b, At at, EpErrorRecord* dev_error) {
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
  b.combine_out = at("combine_out");
  b.combine_out_weights = reinterpret_cast<float*>(at("combine_out_weights"));
  b.sync = reinterpret_cast<EpSyncState*>(at("sync"));
  b.error = dev_error;
}

// The rows of a dispatch launch, which both families' parameters start with (DispatchParams, InterDispatchParams).
inline void FillDispatchPointers(DispatchRows& p, const EpOpConfig& c, uintptr_t input, int row_bytes, int num_tokens,
                                 uintptr_t weights, uintptr_t scales, uintptr_t indices) {
  p.input = reinterpret_cast<const uint8_t*>(input);
  p.weights = reinterpret_cast<const float*>(weights);
  p.scales = c.scale_dim > 0 ? reinterpret_cast<const uint8_t*>(scales) : nullptr;
  p.indices = reinterpret_cast<const int32_t*>(indices);
  p.num_tokens = num_tokens;
  p.row_bytes = row_bytes;
}

// name -> (device pointer, bytes) of the buffers the Python op views.
using BufferTable = std::vector<std::tuple<std::string, uintptr_t, size_t>>;

class EpHandleBase {
 public:
  EpHandleBase(const EpHandleBase&) = delete;
  EpHandleBase& operator=(const EpHandleBase&) = delete;

  // "" while no kernel reported a failure, else a description naming rank, phase and peer.
  std::string ErrorMessage() const;
  int64_t timeout_ms() const { return cfg_.timeout_ms; }
  void set_timeout_ms(int64_t ms);

 protected:
  // Checks the fields both kernel families need; `max_world` / `max_topk` are the family's
  // limits and `family` ends the world-size message ("" or " for the inter-node kernels").
  EpHandleBase(const EpOpConfig& cfg, int max_world, int max_topk, const char* family);
  virtual ~EpHandleBase();

  // Allocates the zeroed host-mapped error record; returns the kernels' (device) alias of it.
  EpErrorRecord* OpenErrorRecord();
  void CloseErrorRecord();
  // True once a kernel recorded a failure (one host load; no sync).
  bool Failed() const { return reinterpret_cast<const volatile EpErrorRecord*>(host_error_)->code != kErrNone; }
  // The kernels read the timeout from `*timeout_ns` (the handle's geometry); set it from the config.
  void BindTimeout(uint64_t* timeout_ns);
  // Launch checks both families share; each message names the argument and the limit, and is
  // built only when the check fails (a launch is on the host's hot path).
  void CheckDispatchRows(uintptr_t input, int row_bytes, int num_tokens, uintptr_t indices) const;
  // Checks a combine of `dtype` (0 bf16, 1 fp32) rows of `hidden_dim`; returns the row bytes.
  int CheckCombineRows(int dtype, int hidden_dim, int num_tokens, uintptr_t indices) const;
  // The op's output buffers in `l` inside `block`, and total_recv in `sync`.
  BufferTable OutputBuffers(const BufferLayout& l, const uint8_t* block, const EpSyncState* sync) const;
  // How error records name this family's phases.
  virtual const char* PhaseName(int phase) const = 0;

  EpOpConfig cfg_;
  int row_cap_ = 0;  // bytes of a token row at hidden_dim * max_token_type_size
  EpErrorRecord* host_error_ = nullptr;

 private:
  uint64_t* timeout_ns_ = nullptr;
};

}  // namespace mori::ep
