// First-fit allocator over the offsets of the symmetric heap.
//
// Symmetry is what makes a heap "symmetric": every rank performs the same
// sequence of Allocate/Free calls, so the same offsets come back everywhere and
// a peer's copy of a buffer is simply peer_base + offset. The allocator itself
// is deterministic (no randomness, no address-dependent choices) to keep that
// true. Pure host code; no GPU calls.
#pragma once

#include <cstddef>
#include <map>

namespace mori::shmem {

class HeapAllocator {
 public:
  explicit HeapAllocator(size_t capacity);

  // Returns the offset of a block of `size` bytes aligned to `alignment` (a
  // power of two). Throws mori::Error naming MORI_SHMEM_HEAP_SIZE when the heap
  // has no free block large enough.
  size_t Allocate(size_t size, size_t alignment);
  // Frees the block that starts at `offset`; throws InvalidArgument if none does.
  void Free(size_t offset);

  size_t capacity() const { return capacity_; }
  size_t used() const { return used_bytes_; }
  size_t LargestFree() const;

 private:
  size_t capacity_;
  size_t used_bytes_ = 0;
  std::map<size_t, size_t> free_;   // offset -> length, coalesced
  std::map<size_t, size_t> blocks_;  // allocated offset -> length
};

}  // namespace mori::shmem
