#include "io/notification_table.hpp"

namespace mori::io {

void NotificationTable::Record(const std::string& remoteKey, TransferUniqueId uid, uint32_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  Key k{remoteKey, uid};
  auto it = entries_.find(k);
  if (it == entries_.end()) {
    while (entries_.size() >= kMaxEntries && !order_.empty()) {
      entries_.erase(order_.front());
      order_.pop_front();
    }
    it = entries_.emplace(k, Entry{0, total}).first;
    order_.push_back(std::move(k));
  }
  it->second.received += 1;
  if (total > it->second.total) it->second.total = total;
}

bool NotificationTable::Pop(const std::string& remoteKey, TransferUniqueId uid) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(Key{remoteKey, uid});
  if (it == entries_.end() || it->second.received < it->second.total) return false;
  entries_.erase(it);
  // The key stays in order_ until it reaches the front; erase() there is a no-op.
  if (order_.size() > 2 * entries_.size() + 1024) {
    std::deque<Key> live;
    for (auto& k : order_)
      if (entries_.count(k)) live.push_back(std::move(k));
    order_.swap(live);
  }
  return true;
}

size_t NotificationTable::Size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace mori::io
