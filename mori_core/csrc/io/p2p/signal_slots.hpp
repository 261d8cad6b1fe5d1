// Completion words in pinned, host-mapped memory, one per copy in flight.
//
// The scatter-copy kernel writes a slot's value into its word when the last
// block finished (scatter_copy.hpp), so the host sees completion by reading
// memory: no event record at submit, no driver call while polling. A slot is
// reused only after its copy was seen complete, and every use gets a new
// value, so a word never reports a copy that is not this slot's current one.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

namespace mori::io::p2p {

class SignalSlots {
 public:
  struct Slot {
    volatile uint32_t* host = nullptr;  // host view of the word
    uint32_t* device = nullptr;         // device view of the same word (kernel argument)
    uint32_t* counter = nullptr;        // device memory: blocks that finished, reset by the last one
    uint32_t value = 0;                 // written by the kernel on completion (never 0)
    uint32_t index = 0;
    explicit operator bool() const { return host != nullptr; }
    bool Signalled() const { return __atomic_load_n(host, __ATOMIC_ACQUIRE) == value; }
  };

  // `device` is the GPU whose kernels write the words.
  explicit SignalSlots(int device) : device_(device) {}
  ~SignalSlots();
  SignalSlots(const SignalSlots&) = delete;
  SignalSlots& operator=(const SignalSlots&) = delete;

  // A free slot (grows by a chunk when all are in flight). Throws GpuError.
  Slot Acquire();
  // Back to the free list: only once the kernel that used it is known to have
  // finished (its word was seen, or its stream drained).
  void Release(const Slot& s);

 private:
  static constexpr uint32_t kChunk = 1024;
  struct Chunk {
    uint32_t* host = nullptr;
    uint32_t* device = nullptr;
    uint32_t* counters = nullptr;
  };
  void Grow();
  const int device_;
  std::mutex mu_;
  std::vector<Chunk> chunks_;
  std::vector<uint32_t> free_;
  std::vector<uint32_t> generation_;
};

}  // namespace mori::io::p2p
