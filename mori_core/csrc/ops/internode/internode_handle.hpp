// InterNodeHandle: buffers, sync state and checked launches of one inter-node
// EP operator. Node-local buffers live in a block of mori_core.shmem's
// symmetric heap that the Python layer allocates (this module is a separate
// extension, so it receives the block and the node peers' byte distances
// instead of reaching into _C's heap); network buffers come from NVSHMEM.
//
// Network path per peer node: "direct" (plain stores through the load/store
// mapping of its NVSHMEM heap, where nvshmem_ptr is not null) or "put" (NVSHMEM
// puts of locally staged rows); `force_put` sends every peer through the put
// path, as if none were load/store-reachable (the network path's logic then
// runs over NVSHMEM's P2P transport).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common/error.hpp"

#include "ops/ep_handle_base.hpp"
#include "ops/internode/internode_types.hpp"

namespace mori::ep::inter {

using InterHandleConfig = EpOpConfig;  // gpu_per_node >= 1

// Thrown by a launch when an earlier kernel of the op recorded a failure (-> EpOpError).
class NetOpFailed : public BadState {
 public:
  using BadState::BadState;
};

class InterNodeHandle : public EpHandleBase {
 public:
  // Bytes of the node-local block (allocate it with shmem_malloc on every rank, same order).
  static size_t IpcBytes(const InterHandleConfig& cfg);
  // Collective: allocates the NVSHMEM buffers (when the group spans nodes) and zeroes everything.
  InterNodeHandle(const InterHandleConfig& cfg, uintptr_t ipc_block, const std::vector<int64_t>& local_peer_delta,
                  int device, bool force_put);
  ~InterNodeHandle() override;

  // Send half; with `finish` the receive half follows on the same stream (every type but AsyncLL).
  // Throws NetOpFailed when an earlier kernel of the op failed.
  void Dispatch(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales,
                uintptr_t indices, int blocks, int warps, int rdma_blocks, bool finish, uintptr_t stream);
  void DispatchRecv(int blocks, int warps, uintptr_t stream);
  void Combine(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights, int weight_rows,
               uintptr_t indices, int num_tokens, bool push, int blocks, int warps, bool finish, uintptr_t stream);
  void CombineRecv(int blocks, int warps, uintptr_t stream);

  BufferTable Buffers() const;
  bool uses_network() const { return args_.geo.nodes > 1; }
  // Peer nodes on each path (direct: load/store; put: NVSHMEM puts).
  int direct_peers() const { return args_.geo.nodes - 1 - args_.geo.put_peers; }
  int put_peers() const { return args_.geo.put_peers; }
  // Network rows per NVSHMEM put on the put path (both directions), in [1, max_num_inp_token_per_rank].
  int put_rows() const { return put_rows_; }
  void set_put_rows(int rows);
  // (device pointer, bytes) of the phase timestamps: int64 [2][kPhaseRing][kPhasePoints].
  std::pair<uintptr_t, size_t> PhaseRing() const;
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
  int put_rows_ = 1;
  bool dispatch_pending_ = false;
  bool combine_pending_ = false;
};

}  // namespace mori::ep::inter
