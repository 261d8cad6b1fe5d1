// Registry of this engine's registered memory.
//
// Every access to registered memory — by a local transfer or on behalf of a
// remote peer — pins the region first. Deregistration revokes the region and
// waits (bounded) for pins to drain, so no backend touches memory after
// deregister_memory() has returned.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "io/common.hpp"

namespace mori::io {

class LocalRegion {
 public:
  explicit LocalRegion(MemoryDesc d) : desc(std::move(d)) {}
  const MemoryDesc desc;

  bool Pin();  // false once revoked
  void Unpin();
  // Refuses new pins and waits up to `timeoutMs` for existing ones; returns
  // false if pins remained (the caller logs it).
  bool RevokeAndDrain(int64_t timeoutMs);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int pins_ = 0;
  bool revoked_ = false;
};

// RAII pin; empty (operator bool false) when the region is gone.
class RegionPin {
 public:
  RegionPin() = default;
  explicit RegionPin(std::shared_ptr<LocalRegion> r);
  RegionPin(RegionPin&& o) noexcept : region_(std::move(o.region_)) {}
  RegionPin& operator=(RegionPin&& o) noexcept;
  RegionPin(const RegionPin&) = delete;
  RegionPin& operator=(const RegionPin&) = delete;
  ~RegionPin();
  explicit operator bool() const { return region_ != nullptr; }
  const MemoryDesc& desc() const { return region_->desc; }
  uint8_t* base() const { return reinterpret_cast<uint8_t*>(region_->desc.data); }

 private:
  std::shared_ptr<LocalRegion> region_;
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
