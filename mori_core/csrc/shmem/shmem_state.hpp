// Process-wide shmem state: at most one symmetric heap per process (MORI's
// model: one rank per process, one GPU per rank). The bootstrap (exchanging the
// heap descriptions between ranks) is done by the Python layer over a
// torch.distributed TCPStore; this layer owns the memory and the mappings.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "shmem/symmetric_heap.hpp"

namespace mori::shmem {

// Default heap size when MORI_SHMEM_HEAP_SIZE is unset (MORI's default).
constexpr uint64_t kDefaultHeapSize = 4ull << 30;

// Creates this rank's heap (size from MORI_SHMEM_HEAP_SIZE unless heap_size > 0).
PeerHeapInfo InitLocal(int rank, int world_size, int device, uint64_t heap_size);
// Maps the peers' heaps; completes initialisation.
void OpenPeers(const std::vector<PeerHeapInfo>& peers);
// Unmaps and frees everything; afterwards Initialized() is false.
void Finalize();

bool Initialized();
// The heap, or BadState telling the user to initialise shmem first.
SymmetricHeap& Heap();
// Bumped by every Finalize(): objects holding heap memory compare it before freeing.
uint64_t Generation();

}  // namespace mori::shmem
