// EpHandle: the buffers, sync state and error record of one EP operator, and
// the checked launch of its dispatch/combine kernels. Tensors arrive as raw
// device pointers from the Python layer (no libtorch).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common/error.hpp"
#include "ops/ep_kernels.hpp"
#include "ops/ep_types.hpp"

namespace mori::ep {

// Raised by a launch when an earlier kernel of the operator reported a failure
// (the op is unusable afterwards); the bindings map it to its own Python type
// so the Python layer can re-raise it as EpOpError without a per-call check.
class OpFailed : public BadState {
 public:
  using BadState::BadState;
};

struct EpHandleConfig {
  int rank = 0;
  int world_size = 1;
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

class EpHandle {
 public:
  // Allocates all buffers from the symmetric heap (collective: every rank must
  // create its handles in the same order) and zeroes them.
  explicit EpHandle(const EpHandleConfig& cfg);
  ~EpHandle();
  EpHandle(const EpHandle&) = delete;
  EpHandle& operator=(const EpHandle&) = delete;

  void Dispatch(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales, uintptr_t indices,
                int blocks, int warps, uintptr_t stream);
  void Combine(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights, int weight_rows,
               bool weights_symmetric, uintptr_t indices, int num_tokens, bool push, int blocks, int warps,
               uintptr_t stream);

  // name -> (device pointer, bytes) of the buffers Python views.
  std::vector<std::tuple<std::string, uintptr_t, size_t>> Buffers() const;
  // "" while no kernel reported a failure, else a description naming rank, phase and peer.
  std::string ErrorMessage() const;
  uint64_t HeapOffset() const { return heap_offset_; }
  int64_t timeout_ms() const { return cfg_.timeout_ms; }
  void set_timeout_ms(int64_t ms);
  int sm_count() const { return sm_count_; }
  int arch_major() const { return arch_major_; }
  // Frees the buffers (collective, like construction). Idempotent.
  void Close();

 private:
  // Throws BadState when closed or shmem was finalised, OpFailed when a kernel
  // of this op reported a failure. Runs before every launch; costs two loads.
  void CheckUsable() const;
  void CheckWarps(int warps, int max_threads, const char* what) const;

  EpHandleConfig cfg_;
  int device_ = -1;
  int sm_count_ = 0;
  int arch_major_ = 0;
  uint64_t generation_ = 0;
  uint8_t* block_ = nullptr;  // one heap allocation holding every buffer
  uint64_t heap_offset_ = 0;
  uint64_t block_bytes_ = 0;
  EpErrorRecord* host_error_ = nullptr;
  EpKernelArgs args_{};
  int row_cap_ = 0;  // bytes of a token row at hidden_dim * max_token_type_size
  std::map<std::tuple<int, bool, int>, int> combine_grid_cap_;
};

}  // namespace mori::ep
