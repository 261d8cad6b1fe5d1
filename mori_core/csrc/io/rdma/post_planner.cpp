#include "io/rdma/post_planner.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace mori::io::rdma {
namespace {

void Validate(const PlanLimits& l) {
  if (l.numQps < 1) throw InvalidArgument("post plan: numQps must be >= 1");
  if (l.postBatchSize == 0 || l.postBatchSize < -1)
    throw InvalidArgument("post plan: post_batch_size must be -1 or >= 1, got " + std::to_string(l.postBatchSize));
  if (l.sqDepth < (l.notify ? 2u : 1u))
    throw InvalidArgument("post plan: send queue depth " + std::to_string(l.sqDepth) + " is too small");
  if (l.maxSge < 1) throw InvalidArgument("post plan: maxSge must be >= 1");
  if (l.maxMsgBytes < 1) throw InvalidArgument("post plan: maxMsgBytes must be >= 1");
  if (l.chunking && (l.chunkBytes < 1 || l.maxChunks < 1))
    throw InvalidArgument("post plan: chunk_bytes and max_chunks_per_transfer must be >= 1");
}

}  // namespace

PostPlan PlanPosts(const SegmentList& segments, uint64_t uid, const PlanLimits& limits) {
  Validate(limits);
  PostPlan plan;
  SegmentList segs;
  segs.reserve(segments.size());
  uint64_t total = 0;
  for (const auto& s : segments)
    if (s.size > 0) {
      segs.push_back(s);
      total += s.size;
    }
  if (segs.empty()) return plan;
  std::stable_sort(segs.begin(), segs.end(),
                   [](const Segment& a, const Segment& b) { return a.remoteOffset < b.remoteOffset; });

  // SGE lengths are 32-bit in the verbs ABI: never let a WR reach 4 GiB.
  uint64_t limit = std::min<uint64_t>(limits.maxMsgBytes, 1ull << 31);
  if (limits.chunking) {
    uint64_t perChunk = std::max<uint64_t>(limits.chunkBytes, (total + limits.maxChunks - 1) / limits.maxChunks);
    limit = std::min(limit, perChunk);
  }
  plan.wrByteLimit = limit;

  auto startWr = [&](const Segment& s, uint64_t take) {
    plan.wrs.push_back({s.remoteOffset, take, static_cast<uint32_t>(plan.sges.size()), 1});
    plan.sges.push_back({s.localOffset, take});
  };
  for (Segment s : segs) {
    while (s.size > 0) {
      PlannedWr* cur = plan.wrs.empty() ? nullptr : &plan.wrs.back();
      bool remoteContiguous = cur && cur->remoteOffset + cur->length == s.remoteOffset && cur->length < limit;
      if (remoteContiguous) {
        uint64_t take = std::min(s.size, limit - cur->length);
        SgePiece& last = plan.sges.back();
        if (last.localOffset + last.length == s.localOffset) {
          last.length += take;
          cur->length += take;
        } else if (static_cast<int>(cur->numSge) < limits.maxSge) {
          plan.sges.push_back({s.localOffset, take});
          cur->numSge++;
          cur->length += take;
        } else {
          startWr(s, std::min(s.size, limit));
          take = plan.wrs.back().length;
        }
        s.localOffset += take;
        s.remoteOffset += take;
        s.size -= take;
      } else {
        uint64_t take = std::min(s.size, limit);
        startWr(s, take);
        s.localOffset += take;
        s.remoteOffset += take;
        s.size -= take;
      }
    }
  }

  const uint64_t nWr = plan.wrs.size();
  const uint64_t capacity = limits.sqDepth - (limits.notify ? 1 : 0);
  uint64_t batch = limits.postBatchSize > 0 ? static_cast<uint64_t>(limits.postBatchSize)
                                            : (nWr + limits.numQps - 1) / limits.numQps;
  batch = std::clamp<uint64_t>(batch, 1, capacity);
  plan.batchSize = static_cast<uint32_t>(batch);
  const uint64_t start = uid % static_cast<uint64_t>(limits.numQps);
  std::vector<bool> used(limits.numQps, false);
  for (uint64_t first = 0, i = 0; first < nWr; first += batch, ++i) {
    int qp = static_cast<int>((i + start) % static_cast<uint64_t>(limits.numQps));
    plan.chains.push_back({qp, static_cast<uint32_t>(first), static_cast<uint32_t>(std::min(batch, nWr - first))});
    used[qp] = true;
  }
  for (int q = 0; q < limits.numQps; ++q)
    if (used[q]) plan.qpsUsed.push_back(q);
  return plan;
}

}  // namespace mori::io::rdma
