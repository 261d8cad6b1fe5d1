#include "io/memory_table.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <chrono>

namespace mori::io {

// ------------------------------------------------------------------ CutHandle
bool CutHandle::SetFd(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  fd_ = fd;
  if (cut_ && fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  return !cut_;
}

void CutHandle::Cut() {
  std::lock_guard<std::mutex> lock(mu_);
  cut_ = true;
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void CutHandle::Detach() {
  std::lock_guard<std::mutex> lock(mu_);
  fd_ = -1;
}

bool CutHandle::IsCut() {
  std::lock_guard<std::mutex> lock(mu_);
  return cut_;
}

// ---------------------------------------------------------------- LocalRegion
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

void LocalRegion::Attach(const CutPtr& c) {
  bool cutNow;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& e = cuts_[c.get()];
    e.first = c;
    ++e.second;
    cutNow = cutting_;
  }
  if (cutNow) c->Cut();
}

void LocalRegion::Detach(const CutPtr& c) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = cuts_.find(c.get());
  if (it != cuts_.end() && --it->second.second == 0) cuts_.erase(it);
}

bool LocalRegion::RevokeAndDrain(int64_t graceMs, int64_t cutWaitMs, size_t* cutCount) {
  std::vector<CutPtr> victims;
  {
    std::unique_lock<std::mutex> lock(mu_);
    revoked_ = true;
    if (cv_.wait_for(lock, std::chrono::milliseconds(graceMs), [&] { return pins_ == 0; })) return true;
    cutting_ = true;
    for (auto& [p, e] : cuts_) victims.push_back(e.first);
  }
  // Cut outside the lock: a cut thread releases its pin through Unpin.
  for (auto& c : victims) c->Cut();
  if (cutCount) *cutCount = victims.size();
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(cutWaitMs), [&] { return pins_ == 0; });
}

// ------------------------------------------------------------------ RegionPin
RegionPin::RegionPin(std::shared_ptr<LocalRegion> r) {
  if (r && r->Pin()) region_ = std::move(r);
}

RegionPin& RegionPin::operator=(RegionPin&& o) noexcept {
  if (this != &o) {
    Release();
    region_ = std::move(o.region_);
    cuts_ = std::move(o.cuts_);
  }
  return *this;
}

void RegionPin::Attach(const CutPtr& c) {
  if (!region_ || !c) return;
  if (std::find(cuts_.begin(), cuts_.end(), c) != cuts_.end()) return;
  cuts_.push_back(c);
  region_->Attach(c);
}

void RegionPin::Release() {
  if (!region_) return;
  for (auto& c : cuts_) region_->Detach(c);
  cuts_.clear();
  region_->Unpin();
  region_.reset();
}

// ---------------------------------------------------------------- MemoryTable
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
