// The `qp_per_transfer` RC queue pairs between one local NIC port and one
// remote NIC port of a peer engine — the unit that is connected, used and,
// after a failure, replaced as a whole.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/rdma/completion_poller.hpp"
#include "io/rdma/queue_pair.hpp"

namespace mori::io::rdma {

struct QpGroup {
  uint64_t id = 0;
  NicPtr nic;
  std::string remoteNic;        // "<device>:<port>" on the peer
  uint32_t remoteMaxMsg = 0;
  uint64_t controlGeneration = 0;  // control connection the peer knows this group by
  std::vector<QpPtr> qps;
  std::weak_ptr<CompletionPoller> poller;
  std::function<void(uint64_t)> onRelease;  // tells the peer it may free its side

  bool Healthy() const {
    return std::none_of(qps.begin(), qps.end(), [](const QpPtr& q) { return q->Broken(); });
  }
  std::string FirstFailure() const {
    for (const auto& q : qps)
      if (q->Broken()) return q->BrokenReason();
    return "";
  }

  ~QpGroup() {
    if (auto p = poller.lock())
      for (const auto& q : qps) p->Remove(q.get());
    if (onRelease) onRelease(id);
  }
};
using GroupPtr = std::shared_ptr<QpGroup>;

}  // namespace mori::io::rdma
