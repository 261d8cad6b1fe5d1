// Text of a failure the EP kernels recorded in an EpErrorRecord, for EpOpError.
// Shared by the IntraNode handle and the inter-node handle, which live in two
// extension modules; hence header-only.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "ops/ep_types.hpp"

namespace mori::ep {

struct EpErrorContext {
  int rank = 0;
  int64_t timeout_ms = 0;
  const char* phase = "EP kernel";  // the failing phase, as the handle names it
  int gpu_per_node = 0;             // > 0 (inter-node kernels): also name the peer's node
};

// Copies the host-mapped record field by field (the kernels write it; `code` last).
inline EpErrorRecord ReadErrorRecord(const volatile EpErrorRecord* r) {
  EpErrorRecord e{};
  e.code = r->code;
  e.phase = r->phase;
  e.peer = r->peer;
  e.block = r->block;
  e.a = r->a;
  e.b = r->b;
  return e;
}

inline std::string DescribeEpError(const EpErrorRecord& e, const EpErrorContext& c) {
  std::ostringstream os;
  switch (e.code) {
    case kErrTimeout:
      os << "EP " << c.phase << " on rank " << c.rank << " timed out after " << c.timeout_ms
         << " ms waiting for peer rank " << e.peer;
      if (c.gpu_per_node > 0) os << " (node " << e.peer / c.gpu_per_node << ",";
      else os << " (";
      os << " expected round " << e.a << ", last seen " << e.b << "): that rank never reached this " << c.phase
         << "; is it alive and calling dispatch/combine the same number of times? (timeout: MORI_EP_TIMEOUT_MS)";
      break;
    case kErrSendOverflow:
      os << "EP " << c.phase << " on rank " << c.rank << ": rank " << e.peer << " ran out of receive capacity (slot "
         << e.a << " >= " << e.b << "); rows beyond it were dropped; raise max_total_recv_tokens";
      break;
    case kErrRecvOverflow:
      os << "EP " << c.phase << " on rank " << c.rank << ": " << e.a << " rows were sent to this rank";
      if (e.peer >= 0) os << " (counted when rank " << e.peer << "'s arrived)";
      os << ", capacity is " << e.b << "; rows beyond it were dropped and total_recv was clamped; "
         << "raise max_total_recv_tokens";
      break;
    case kErrCombineRows:
      os << "EP combine on rank " << c.rank << ": input has " << e.b << " rows but dispatch received " << e.a
         << " tokens; pass at least total_recv rows";
      break;
    case kErrCombineWeightRows:
      os << "EP combine on rank " << c.rank << ": weights have " << e.b << " rows but dispatch received " << e.a
         << " tokens; pass at least total_recv rows";
      break;
    case kErrRoutingMismatch:
      os << "EP combine on rank " << c.rank << ": indices of token " << e.a << " route to rank mask 0x" << std::hex
         << (static_cast<uint64_t>(e.b) >> 32) << " but dispatch sent it to 0x"
         << (static_cast<uint64_t>(e.b) & 0xffffffffu) << std::dec;
      if (c.gpu_per_node > 0) os << " (low 32 ranks shown)";
      os << "; pass this rank's own routing indices from dispatch";
      break;
    case kErrStdStale:
      os << "EP " << c.phase << " on rank " << c.rank << ": no standard-MoE layout of the current dispatch (round "
         << e.b << ", layout of round " << e.a
         << "); call dispatch_standard_moe() or convert_dispatch_output() after dispatch() first";
      break;
    case kErrConvertRows:
      os << "EP convert_dispatch_output on rank " << c.rank << ": given " << e.b << " rows but dispatch received "
         << e.a << " tokens; pass the dispatch outputs (at least total_recv rows)";
      break;
    default:
      os << "EP kernel on rank " << c.rank << " reported error code " << e.code;
  }
  os << " [the operator is now unusable; recreate it on every rank]";
  return os.str();
}

}  // namespace mori::ep
