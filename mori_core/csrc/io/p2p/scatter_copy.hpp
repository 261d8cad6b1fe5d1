// One kernel launch that copies a batch of many scattered segments between
// GPU-accessible pointers (local and peer memory mapped over NVLink). For a
// few large segments the copy engines are better; XgmiBackend decides.
//
// Work is cut into pieces of `pieceBytes` (the tail of a segment is a shorter
// piece). Each block takes a run of consecutive pieces, finds the segment of
// its first piece by a binary search over the segments' first-piece indices
// and walks forward from there; threads move 16-byte vectors when source and
// destination allow it. With `maxBlocks` = 0 the grid has one block per piece.
//
// Where the segments come from:
//  * up to kParamSegments segments travel in the kernel's parameter block (no
//    upload, nothing to track: the cheapest launch for small batches);
//  * more go through a SegmentTable: written into pinned host memory, copied
//    to the device with one async copy on the launch's stream, read there by
//    the kernel. Any number of segments is then one launch (a parameter block
//    of 1,024 segments cost 12 us of launch API time, and 8,192 segments took
//    8 launches).
// When a signal is given, the last block to finish makes every copy visible
// to the whole system and then writes `value` into a host-mapped word: the
// host learns of completion by reading memory instead of querying an event.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "common/gpu_runtime.hpp"

namespace mori::io::p2p {

struct CopySeg {
  uint64_t src;
  uint64_t dst;
  uint64_t size;
};

struct ScatterShape {
  uint32_t pieceBytes = 16 << 10;  // power of two in [4 KiB, 1 MiB]: bytes one block copies at a time
  uint32_t threads = 256;          // threads per block: multiple of 32 in [64, 1024]
  uint32_t maxBlocks = 0;          // grid cap: 0 = one block per piece, else [1, 65536]
};

struct KernelSignal {
  uint32_t* counter = nullptr;  // device memory, 0 before the launch; the last block resets it to 0
  uint32_t* flag = nullptr;     // host-mapped word (device view); nullptr = no signal
  uint32_t value = 0;           // written into *flag when every copy landed
};

// Segments a launch carries in its parameter block; more need a SegmentTable.
constexpr size_t kParamSegments = 64;

// Descriptors of one launch in device memory, staged through pinned host
// memory. A table is reused only after the launch that read it completed
// (SegmentTablePool hands it out again once released).
class SegmentTable {
 public:
  struct Entry {  // 32 bytes: the kernel reads one aligned line per lookup
    uint64_t src;
    uint64_t dst;
    uint64_t size;
    uint32_t firstPiece;  // index of the segment's first piece in the launch
    uint32_t pad;
  };
  // Allocates `capacity` entries on `device` (pinned host + device). Throws GpuError.
  SegmentTable(int device, size_t capacity);
  ~SegmentTable();
  SegmentTable(const SegmentTable&) = delete;
  SegmentTable& operator=(const SegmentTable&) = delete;

  size_t capacity() const { return capacity_; }
  Entry* host() { return host_; }
  const Entry* device() const { return device_; }
  int deviceId() const { return deviceId_; }

 private:
  int deviceId_;
  size_t capacity_;
  Entry* host_ = nullptr;
  Entry* device_ = nullptr;
};

// Free tables of one device (a launch takes one, its completion gives it back).
class SegmentTablePool {
 public:
  explicit SegmentTablePool(int device) : device_(device) {}
  // A table of at least `count` entries (caller has the device current). Throws GpuError.
  std::unique_ptr<SegmentTable> Acquire(size_t count);
  void Release(std::unique_ptr<SegmentTable> t);

 private:
  static constexpr size_t kKeep = 16;  // free tables kept for reuse; more are freed
  const int device_;
  std::mutex mu_;
  std::vector<std::unique_ptr<SegmentTable>> free_;
};

// Enqueues copies of `segs` on `stream` (its device current), `count` <= kParamSegments.
// Throws GpuError, or InvalidArgument for a shape out of range.
void LaunchScatterCopy(const CopySeg* segs, size_t count, const ScatterShape& shape, const KernelSignal& signal,
                       gpuStream_t stream);

// Any number of segments, one launch: the caller wrote src/dst/size of
// entries [0, count) into table.host(); this fills their first pieces,
// uploads them on `stream` and launches. The table must stay untouched until
// the launch completed.
void LaunchScatterTable(SegmentTable& table, size_t count, const ScatterShape& shape, const KernelSignal& signal,
                        gpuStream_t stream);

// Checks a shape (InvalidArgument naming the field and its range).
void CheckScatterShape(const ScatterShape& shape);

}  // namespace mori::io::p2p
