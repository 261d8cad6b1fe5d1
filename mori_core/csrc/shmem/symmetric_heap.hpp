// The symmetric heap of one rank: one device allocation of the same size on
// every rank of a node, mapped into every other rank through CUDA/HIP IPC.
//
// A buffer at offset `off` in this rank's heap has a twin at the same offset in
// every peer's heap, so a kernel reaches peer `pe`'s twin at
// PeerBase(pe) + off. The table of peer bases also lives on the device
// (DevicePeerBases) for kernels that index it at run time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shmem/heap_allocator.hpp"

namespace mori::shmem {

// What a rank publishes so that its peers can map its heap.
struct PeerHeapInfo {
  int rank = -1;
  int64_t pid = 0;        // same pid -> same process: use the raw pointer
  int device = -1;
  uint64_t base = 0;      // device address in the owner's process
  uint64_t size = 0;
  std::string ipc_handle; // raw bytes of the IPC handle of `base`
};

class SymmetricHeap {
 public:
  // Allocates and zeroes `size` bytes on `device` (which becomes current for the call only).
  SymmetricHeap(int rank, int world_size, int device, uint64_t size);
  ~SymmetricHeap();
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  PeerHeapInfo LocalInfo() const;
  // Maps every peer's heap (entries indexed by rank; this rank's own entry is
  // ignored). Sizes must all match.
  void OpenPeers(const std::vector<PeerHeapInfo>& peers);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  uint64_t size() const { return size_; }
  uint8_t* base() const { return base_; }
  bool peers_open() const { return peers_open_; }
  uint8_t* PeerBase(int pe) const;
  // Address of `local` (inside this heap) as seen in peer `pe`'s heap twin.
  void* PeerPtr(const void* local, int pe) const;
  bool Contains(const void* p) const;
  // Device array of world_size uint64 peer base addresses.
  const uint64_t* DevicePeerBases() const { return device_peer_bases_; }

  void* Malloc(uint64_t size, uint64_t alignment);
  void Free(void* p);
  const HeapAllocator& allocator() const { return alloc_; }

 private:
  void ClosePeers() noexcept;

  int rank_, world_size_, device_;
  uint64_t size_;
  uint8_t* base_ = nullptr;
  uint64_t* device_peer_bases_ = nullptr;
  std::vector<uint8_t*> peer_bases_;
  std::vector<bool> peer_is_ipc_;  // true: opened with IpcOpenMemHandle, must be closed
  bool peers_open_ = false;
  HeapAllocator alloc_;
};

}  // namespace mori::shmem
