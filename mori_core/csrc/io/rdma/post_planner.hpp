// Turns one transfer's segments into work requests and post chains.
//
//  1. Segments are ordered by remote offset; neighbours that are contiguous on
//     the remote side become one work request (WR). Their local pieces become
//     the WR's scatter/gather list: a local-contiguous piece extends the last
//     SGE, otherwise a new SGE is added, up to `maxSge`.
//  2. No WR exceeds the port's maximum message size, nor — with chunking on —
//     max(chunk_bytes, total / max_chunks_per_transfer), so one large
//     transfer spreads over several QPs.
//  3. WRs are cut into chains of `postBatchSize` (-1 = ceil(#WR / #QP), i.e.
//     one chain per QP), never longer than the send queue minus the slot kept
//     for the notification. Chain i goes to QP (i + uid) % numQps, so
//     consecutive transfers start on different QPs.
//  4. Each chain is posted with one ibv_post_send; only its last WR is
//     signalled, and that completion returns the SQ slots of the whole chain.
// Pure logic: no verbs, testable without a NIC.
#pragma once

#include <cstdint>
#include <vector>

#include "io/segments.hpp"

namespace mori::io::rdma {

struct PlanLimits {
  int numQps = 1;
  int postBatchSize = -1;          // -1 = automatic
  uint32_t sqDepth = 8192;         // send-queue slots per QP
  int maxSge = 4;
  uint64_t maxMsgBytes = 1ull << 31;
  bool chunking = false;
  uint64_t chunkBytes = 65536;
  int maxChunks = 64;
  bool notify = true;              // keep one SQ slot per chain's QP for the notification
};

struct SgePiece {
  uint64_t localOffset;
  uint64_t length;
};

struct PlannedWr {
  uint64_t remoteOffset;
  uint64_t length;
  uint32_t firstSge;
  uint32_t numSge;
};

struct PlannedChain {
  int qp;
  uint32_t firstWr;
  uint32_t numWrs;  // the last one is the signalled WR
};

struct PostPlan {
  std::vector<SgePiece> sges;
  std::vector<PlannedWr> wrs;
  std::vector<PlannedChain> chains;  // in posting order
  std::vector<int> qpsUsed;          // ascending, each once
  uint64_t wrByteLimit = 0;          // largest WR this plan allowed
  uint32_t batchSize = 0;            // effective chain length
};

// Throws mori::InvalidArgument when a limit is out of range.
PostPlan PlanPosts(const SegmentList& segments, uint64_t uid, const PlanLimits& limits);

}  // namespace mori::io::rdma
