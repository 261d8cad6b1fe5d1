// Registry of this engine's registered memory.
//
// Every access to registered memory — by a local transfer or on behalf of a
// remote peer — pins the region first. A pin held by a thread that moves the
// region's bytes through a socket also attaches that socket's CutHandle.
// Deregistration revokes the region (no new pins), gives running transfers a
// short grace to finish, then cuts the sockets still attached and waits for
// their pins to drop: deregister_memory() returns only when no transfer can
// touch the memory any more, however slowly a peer feeds its bytes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "io/common.hpp"

namespace mori::io {

// A socket that can be shut down from another thread without racing its close.
class CutHandle {
 public:
  explicit CutHandle(int fd = -1) : fd_(fd) {}
  // Sets the socket once it exists; false (and shut down) if Cut came first.
  bool SetFd(int fd);
  // Shuts the socket down so every thread blocked on it returns (idempotent).
  void Cut();
  // Forgets the descriptor (call before it is closed).
  void Detach();
  bool IsCut();

 private:
  std::mutex mu_;
  int fd_;
  bool cut_ = false;
};
using CutPtr = std::shared_ptr<CutHandle>;

class LocalRegion {
 public:
  explicit LocalRegion(MemoryDesc d) : desc(std::move(d)) {}
  const MemoryDesc desc;

  bool Pin();  // false once revoked
  void Unpin();
  // While attached, Revoke may cut `c` (a cut that comes later cuts at once).
  void Attach(const CutPtr& c);
  void Detach(const CutPtr& c);
  // Refuses new pins, waits up to graceMs for the pins to drop, then cuts the
  // attached sockets and waits up to cutWaitMs more. False if pins remained.
  bool RevokeAndDrain(int64_t graceMs, int64_t cutWaitMs, size_t* cutCount = nullptr);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int pins_ = 0;
  bool revoked_ = false;
  bool cutting_ = false;
  std::map<CutHandle*, std::pair<CutPtr, int>> cuts_;
};

// RAII pin; empty (operator bool false) when the region is gone.
class RegionPin {
 public:
  RegionPin() = default;
  explicit RegionPin(std::shared_ptr<LocalRegion> r);
  RegionPin(RegionPin&& o) noexcept : region_(std::move(o.region_)), cuts_(std::move(o.cuts_)) {}
  RegionPin& operator=(RegionPin&& o) noexcept;
  RegionPin(const RegionPin&) = delete;
  RegionPin& operator=(const RegionPin&) = delete;
  ~RegionPin() { Release(); }
  explicit operator bool() const { return region_ != nullptr; }
  const MemoryDesc& desc() const { return region_->desc; }
  uint8_t* base() const { return reinterpret_cast<uint8_t*>(region_->desc.data); }
  // Lets deregistration cut `c` while this pin lives (once per handle).
  void Attach(const CutPtr& c);

 private:
  void Release();
  std::shared_ptr<LocalRegion> region_;
  std::vector<CutPtr> cuts_;
};

class MemoryTable {
 public:
  MemoryUniqueId NextId() { return nextId_.fetch_add(1); }
  void Add(const MemoryDesc& desc);
  // Removes and returns the region (nullptr if unknown).
  std::shared_ptr<LocalRegion> Remove(MemoryUniqueId id);
  // Pins region `id`; empty pin when it is not registered.
  RegionPin Pin(MemoryUniqueId id) const;
  bool Contains(MemoryUniqueId id) const;
  std::shared_ptr<LocalRegion> Find(MemoryUniqueId id) const;

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<MemoryUniqueId, std::shared_ptr<LocalRegion>> regions_;
  std::atomic<MemoryUniqueId> nextId_{1};
};

}  // namespace mori::io
