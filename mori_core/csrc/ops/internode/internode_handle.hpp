// InterNodeHandle: buffers, sync state and checked launches of one inter-node
// EP operator. Node-local buffers live in a block of mori_core.shmem's
// symmetric heap that the Python layer allocates (this module is a separate
// extension, so it receives the block and the node peers' byte distances
// instead of reaching into _C's heap); network buffers come from NVSHMEM.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/ep_handle_base.hpp"
#include "ops/internode/internode_types.hpp"

namespace mori::ep::inter {

using InterHandleConfig = EpOpConfig;  // gpu_per_node >= 1

class InterNodeHandle : public EpHandleBase {
 public:
  // Bytes of the node-local block (allocate it with shmem_malloc on every rank, same order).
  static size_t IpcBytes(const InterHandleConfig& cfg);
  // Collective: allocates the NVSHMEM buffers (when the group spans nodes) and zeroes everything.
  InterNodeHandle(const InterHandleConfig& cfg, uintptr_t ipc_block, const std::vector<int64_t>& local_peer_delta,
                  int device);
  ~InterNodeHandle() override;

  void DispatchSend(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales,
                    uintptr_t indices, int blocks, int warps, int rdma_blocks, uintptr_t stream);
  void DispatchRecv(int blocks, int warps, uintptr_t stream);
  void CombineSend(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights, int weight_rows,
                   uintptr_t indices, int num_tokens, bool push, int blocks, int warps, uintptr_t stream);
  void CombineRecv(int blocks, int warps, uintptr_t stream);

  BufferTable Buffers() const;
  bool uses_network() const { return args_.geo.nodes > 1; }
  // Frees the NVSHMEM buffers (collective). The node-local block belongs to the caller.
  void Close();

 private:
  void CheckOpen() const;
  void CheckGrid(int blocks, int warps) const;
  const char* PhaseName(int phase) const override;

  int device_ = -1;
  uint8_t* ipc_ = nullptr;
  uint8_t* net_ = nullptr;
  InterArgs args_{};
  InterDispatchParams dispatch_{};
  InterCombineParams combine_{};
  int combine_dtype_ = 0;
  bool dispatch_pending_ = false;
  bool combine_pending_ = false;
};

}  // namespace mori::ep::inter
