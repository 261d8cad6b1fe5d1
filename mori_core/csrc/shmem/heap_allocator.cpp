#include "shmem/heap_allocator.hpp"

#include <algorithm>
#include <string>

#include "common/error.hpp"

namespace mori::shmem {

namespace {
std::string Human(size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  snprintf(buf, sizeof(buf), "%.1f %s", v, units[u]);
  return buf;
}
}  // namespace

HeapAllocator::HeapAllocator(size_t capacity) : capacity_(capacity) {
  if (capacity > 0) free_[0] = capacity;
}

size_t HeapAllocator::LargestFree() const {
  size_t best = 0;
  for (const auto& [off, len] : free_) best = std::max(best, len);
  return best;
}

size_t HeapAllocator::Allocate(size_t size, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw InvalidArgument("shmem alignment must be a power of two, got " + std::to_string(alignment));
  if (size == 0) size = 1;  // distinct non-null blocks for zero-byte requests
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const size_t off = it->first, len = it->second;
    const size_t start = (off + alignment - 1) & ~(alignment - 1);
    if (start < off || start - off > len || len - (start - off) < size) continue;
    free_.erase(it);
    if (start > off) free_[off] = start - off;
    const size_t tail = off + len - (start + size);
    if (tail > 0) free_[start + size] = tail;
    blocks_[start] = size;
    used_bytes_ += size;
    return start;
  }
  throw Error("mori shmem: symmetric heap exhausted: requested " + Human(size) + " (alignment " +
              std::to_string(alignment) + "), largest free block " + Human(LargestFree()) + ", " + Human(used_bytes_) +
              " of " + Human(capacity_) +
              " in use; raise MORI_SHMEM_HEAP_SIZE (e.g. MORI_SHMEM_HEAP_SIZE=16G) before shmem init");
}

void HeapAllocator::Free(size_t offset) {
  auto it = blocks_.find(offset);
  if (it == blocks_.end())
    throw InvalidArgument("mori shmem: shmem_free of an address that shmem_malloc did not return (offset " +
                          std::to_string(offset) + ")");
  size_t start = offset, len = it->second;
  used_bytes_ -= len;
  blocks_.erase(it);
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = len;
}

}  // namespace mori::shmem
