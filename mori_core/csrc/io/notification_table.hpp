// Target-side record of inbound transfers (pop_inbound_transfer_status).
//
// An initiator splits a transfer into `total` parts (frames, QPs, copies) and
// every part that lands here is counted under (initiator engine key, uid).
// The transfer is complete when all parts arrived. Completed entries are
// removed by Pop(); the table is bounded so an initiator that never gets
// popped cannot grow it without limit (oldest entries are dropped first).
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>

#include "io/common.hpp"

namespace mori::io {

class NotificationTable {
 public:
  static constexpr size_t kMaxEntries = 1 << 20;

  void Record(const std::string& remoteKey, TransferUniqueId uid, uint32_t total);
  // True (and the entry is erased) when every part of (remoteKey, uid) arrived.
  bool Pop(const std::string& remoteKey, TransferUniqueId uid);
  size_t Size() const;

 private:
  struct Entry {
    uint32_t received = 0;
    uint32_t total = 0;
  };
  struct Key {
    std::string remote;
    TransferUniqueId uid;
    bool operator==(const Key& o) const { return uid == o.uid && remote == o.remote; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return std::hash<std::string>()(k.remote) ^ (k.uid * 0x9e3779b97f4a7c15ull); }
  };
  mutable std::mutex mu_;
  std::unordered_map<Key, Entry, KeyHash> entries_;
  std::deque<Key> order_;  // insertion order, for bounded eviction
};

}  // namespace mori::io
