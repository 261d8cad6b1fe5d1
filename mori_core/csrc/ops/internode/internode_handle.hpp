// InterNodeHandle: buffers, sync state and checked launches of one inter-node
// EP operator. Node-local buffers live in a block of mori_core.shmem's
// symmetric heap that the Python layer allocates (this module is a separate
// extension, so it receives the block and the node peers' byte distances
// instead of reaching into _C's heap); network buffers come from NVSHMEM.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "ops/internode/internode_types.hpp"

namespace mori::ep::inter {

struct InterHandleConfig {
  int rank = 0;
  int world_size = 1;
  int gpu_per_node = 1;
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

class InterNodeHandle {
 public:
  // Bytes of the node-local block (allocate it with shmem_malloc on every rank, same order).
  static size_t IpcBytes(const InterHandleConfig& cfg);
  // Collective: allocates the NVSHMEM buffers (when the group spans nodes) and zeroes everything.
  InterNodeHandle(const InterHandleConfig& cfg, uintptr_t ipc_block, const std::vector<int64_t>& local_peer_delta,
                  int device);
  ~InterNodeHandle();
  InterNodeHandle(const InterNodeHandle&) = delete;
  InterNodeHandle& operator=(const InterNodeHandle&) = delete;

  void DispatchSend(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales,
                    uintptr_t indices, int blocks, int warps, int rdma_blocks, uintptr_t stream);
  void DispatchRecv(int blocks, int warps, uintptr_t stream);
  void CombineSend(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights, int weight_rows,
                   uintptr_t indices, int num_tokens, bool push, int blocks, int warps, uintptr_t stream);
  void CombineRecv(int blocks, int warps, uintptr_t stream);

  std::vector<std::tuple<std::string, uintptr_t, size_t>> Buffers() const;
  std::string ErrorMessage() const;
  int64_t timeout_ms() const { return cfg_.timeout_ms; }
  void set_timeout_ms(int64_t ms);
  bool uses_network() const { return args_.geo.nodes > 1; }
  // Frees the NVSHMEM buffers (collective). The node-local block belongs to the caller.
  void Close();

 private:
  void CheckOpen() const;
  void CheckGrid(int blocks, int warps) const;

  InterHandleConfig cfg_;
  int device_ = -1;
  uint8_t* ipc_ = nullptr;
  uint8_t* net_ = nullptr;
  EpErrorRecord* host_error_ = nullptr;
  InterArgs args_{};
  int row_cap_ = 0;
  InterDispatchParams dispatch_{};
  InterCombineParams combine_{};
  int combine_dtype_ = 0;
  bool dispatch_pending_ = false;
  bool combine_pending_ = false;
};

}  // namespace mori::ep::inter
