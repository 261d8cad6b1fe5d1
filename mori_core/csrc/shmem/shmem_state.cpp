#include "shmem/shmem_state.hpp"

#include <memory>

#include "common/env.hpp"
#include "common/error.hpp"

namespace mori::shmem {

namespace {
std::mutex g_mu;
std::unique_ptr<SymmetricHeap> g_heap;
uint64_t g_generation = 1;
}  // namespace

PeerHeapInfo InitLocal(int rank, int world_size, int device, uint64_t heap_size) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_heap) throw BadState("mori shmem is already initialised in this process; call shmem_finalize() first");
  if (heap_size == 0) heap_size = env::GetSize("MORI_SHMEM_HEAP_SIZE", kDefaultHeapSize);
  // Round up to the 2 MiB granularity of the heap.
  heap_size = (heap_size + (1ull << 21) - 1) & ~((1ull << 21) - 1);
  g_heap = std::make_unique<SymmetricHeap>(rank, world_size, device, heap_size);
  return g_heap->LocalInfo();
}

void OpenPeers(const std::vector<PeerHeapInfo>& peers) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_heap) throw BadState("mori shmem: OpenPeers before InitLocal");
  g_heap->OpenPeers(peers);
}

void Finalize() {
  std::lock_guard<std::mutex> lk(g_mu);
  g_heap.reset();
  ++g_generation;
}

bool Initialized() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_heap && g_heap->peers_open();
}

SymmetricHeap& Heap() {
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_heap || !g_heap->peers_open())
    throw BadState(
        "mori shmem is not initialised: call mori_core.shmem.shmem_torch_process_group_init(group_name) or "
        "shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world_size, unique_id) first");
  return *g_heap;
}

uint64_t Generation() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_generation;
}

}  // namespace mori::shmem
