#include "io/memory_table.hpp"

#include <chrono>

namespace mori::io {

bool LocalRegion::Pin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (revoked_) return false;
  ++pins_;
  return true;
}

void LocalRegion::Unpin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--pins_ == 0) cv_.notify_all();
}

bool LocalRegion::RevokeAndDrain(int64_t timeoutMs) {
  std::unique_lock<std::mutex> lock(mu_);
  revoked_ = true;
  return cv_.wait_for(lock, std::chrono::milliseconds(timeoutMs), [&] { return pins_ == 0; });
}

RegionPin::RegionPin(std::shared_ptr<LocalRegion> r) {
  if (r && r->Pin()) region_ = std::move(r);
}

RegionPin& RegionPin::operator=(RegionPin&& o) noexcept {
  if (this != &o) {
    if (region_) region_->Unpin();
    region_ = std::move(o.region_);
  }
  return *this;
}

RegionPin::~RegionPin() {
  if (region_) region_->Unpin();
}

void MemoryTable::Add(const MemoryDesc& desc) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  regions_[desc.id] = std::make_shared<LocalRegion>(desc);
}

std::shared_ptr<LocalRegion> MemoryTable::Remove(MemoryUniqueId id) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return nullptr;
  auto r = std::move(it->second);
  regions_.erase(it);
  return r;
}

std::shared_ptr<LocalRegion> MemoryTable::Find(MemoryUniqueId id) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

RegionPin MemoryTable::Pin(MemoryUniqueId id) const { return RegionPin(Find(id)); }

bool MemoryTable::Contains(MemoryUniqueId id) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return regions_.count(id) != 0;
}

}  // namespace mori::io
