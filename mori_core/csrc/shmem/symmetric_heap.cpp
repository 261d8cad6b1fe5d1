#include "shmem/symmetric_heap.hpp"

#include <unistd.h>

#include <cstring>

#include "common/error.hpp"
#include "common/logging.hpp"
#include "shmem/gpu_ext.hpp"

namespace mori::shmem {

namespace {
// Large allocations are aligned to this so that every sub-buffer can be, too.
constexpr uint64_t kHeapAlignment = 1 << 21;
}

SymmetricHeap::SymmetricHeap(int rank, int world_size, int device, uint64_t size)
    : rank_(rank), world_size_(world_size), device_(device), size_(size), alloc_(size) {
  if (world_size < 1) throw InvalidArgument("shmem world_size must be >= 1");
  if (rank < 0 || rank >= world_size)
    throw InvalidArgument("shmem rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world_size) + ")");
  if (size == 0 || size % kHeapAlignment)
    throw InvalidArgument("MORI_SHMEM_HEAP_SIZE must be a positive multiple of 2 MiB, got " + std::to_string(size));
  DeviceGuard guard(device);
  gpuError_t err = gpuMalloc(reinterpret_cast<void**>(&base_), size);
  if (err != gpuSuccess) {
    (void)gpuGetLastError();
    throw Error("mori shmem: allocating the " + std::to_string(size >> 20) + " MiB symmetric heap on device " +
                std::to_string(device) + " failed (" + gpuGetErrorString(err) +
                "); lower MORI_SHMEM_HEAP_SIZE or free GPU memory");
  }
  MORI_GPU_CHECK(gpuMemset(base_, 0, size));
  MORI_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&device_peer_bases_), sizeof(uint64_t) * world_size));
  peer_bases_.assign(world_size, nullptr);
  peer_is_ipc_.assign(world_size, false);
  peer_bases_[rank] = base_;
}

SymmetricHeap::~SymmetricHeap() {
  ClosePeers();
  DeviceGuard guard(device_);
  if (device_peer_bases_) (void)gpuFree(device_peer_bases_);
  if (base_) (void)gpuFree(base_);
}

PeerHeapInfo SymmetricHeap::LocalInfo() const {
  PeerHeapInfo info;
  info.rank = rank_;
  info.pid = static_cast<int64_t>(getpid());
  info.device = device_;
  info.base = reinterpret_cast<uint64_t>(base_);
  info.size = size_;
  gpuIpcMemHandle_t h;
  {
    DeviceGuard guard(device_);
    MORI_GPU_CHECK(gpuIpcGetMemHandle(&h, base_));
  }
  info.ipc_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return info;
}

void SymmetricHeap::OpenPeers(const std::vector<PeerHeapInfo>& peers) {
  if (peers_open_) throw BadState("mori shmem: peers are already open");
  if (static_cast<int>(peers.size()) != world_size_)
    throw InvalidArgument("mori shmem: expected " + std::to_string(world_size_) + " peer descriptions, got " +
                          std::to_string(peers.size()));
  DeviceGuard guard(device_);
  const int64_t my_pid = static_cast<int64_t>(getpid());
  try {
    for (int pe = 0; pe < world_size_; ++pe) {
      if (pe == rank_) continue;
      const PeerHeapInfo& p = peers[pe];
      if (p.rank != pe) throw InvalidArgument("mori shmem: peer description " + std::to_string(pe) + " is for rank " + std::to_string(p.rank));
      if (p.size != size_)
        throw InvalidArgument("mori shmem: rank " + std::to_string(pe) + " has a " + std::to_string(p.size >> 20) +
                              " MiB heap, this rank " + std::to_string(size_ >> 20) +
                              " MiB; set the same MORI_SHMEM_HEAP_SIZE on every rank");
      if (p.pid == my_pid) {
        // Same process, another device: use the pointer directly.
        if (p.device == device_) throw InvalidArgument("mori shmem: two ranks of one process share device " + std::to_string(device_));
        gpuError_t e = gpuDeviceEnablePeerAccess(p.device, 0);
        if (e != gpuSuccess && e != gpuErrorPeerAccessAlreadyEnabled) MORI_GPU_CHECK(e);
        (void)gpuGetLastError();
        peer_bases_[pe] = reinterpret_cast<uint8_t*>(p.base);
        continue;
      }
      if (p.ipc_handle.empty()) continue;  // a peer on another node: not mapped (PeerBase() refuses it)
      if (p.ipc_handle.size() != sizeof(gpuIpcMemHandle_t))
        throw InvalidArgument("mori shmem: rank " + std::to_string(pe) + " sent a malformed IPC handle");
      gpuIpcMemHandle_t h;
      std::memcpy(&h, p.ipc_handle.data(), sizeof(h));
      void* mapped = nullptr;
      gpuError_t e = gpuIpcOpenMemHandle(&mapped, h, gpuIpcMemLazyEnablePeerAccess);
      if (e != gpuSuccess) {
        (void)gpuGetLastError();
        throw Error("mori shmem: mapping rank " + std::to_string(pe) + "'s heap (device " + std::to_string(p.device) +
                    ") failed: " + gpuGetErrorString(e) +
                    "; all ranks must be processes on one node whose GPUs can access each other (NVLink/PCIe P2P)");
      }
      peer_bases_[pe] = static_cast<uint8_t*>(mapped);
      peer_is_ipc_[pe] = true;
    }
  } catch (...) {
    ClosePeers();
    throw;
  }
  std::vector<uint64_t> bases(world_size_);
  for (int pe = 0; pe < world_size_; ++pe) bases[pe] = reinterpret_cast<uint64_t>(peer_bases_[pe]);
  MORI_GPU_CHECK(gpuMemcpy(device_peer_bases_, bases.data(), sizeof(uint64_t) * world_size_, gpuMemcpyHostToDevice));
  peers_open_ = true;
}

void SymmetricHeap::ClosePeers() noexcept {
  DeviceGuard guard(device_);
  for (int pe = 0; pe < world_size_; ++pe) {
    if (peer_is_ipc_[pe] && peer_bases_[pe]) (void)gpuIpcCloseMemHandle(peer_bases_[pe]);
    peer_is_ipc_[pe] = false;
    if (pe != rank_) peer_bases_[pe] = nullptr;
  }
  peers_open_ = false;
}

uint8_t* SymmetricHeap::PeerBase(int pe) const {
  if (pe < 0 || pe >= world_size_) throw InvalidArgument("mori shmem: pe " + std::to_string(pe) + " out of range");
  if (!peer_bases_[pe]) throw BadState("mori shmem: rank " + std::to_string(pe) + "'s heap is not mapped");
  return peer_bases_[pe];
}

bool SymmetricHeap::Contains(const void* p) const {
  auto u = reinterpret_cast<const uint8_t*>(p);
  return u >= base_ && u < base_ + size_;
}

void* SymmetricHeap::PeerPtr(const void* local, int pe) const {
  if (!Contains(local)) throw InvalidArgument("mori shmem: address is not inside the symmetric heap");
  return PeerBase(pe) + (reinterpret_cast<const uint8_t*>(local) - base_);
}

void* SymmetricHeap::Malloc(uint64_t size, uint64_t alignment) {
  return base_ + alloc_.Allocate(size, alignment < 256 ? 256 : alignment);
}

void SymmetricHeap::Free(void* p) {
  if (!Contains(p)) throw InvalidArgument("mori shmem: shmem_free of an address outside the symmetric heap");
  alloc_.Free(static_cast<uint8_t*>(p) - base_);
}

}  // namespace mori::shmem
