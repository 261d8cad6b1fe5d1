// Wire format of the TCP data channel (after the control-plane handshake).
//
// Initiator -> target, one frame per request:
//   RequestHeader | WireSegment[numSegments] | payload (WRITE only)
// Target -> initiator, one reply per request, in request order:
//   ReplyHeader | message[messageLen] | payload (READ_DATA only)
//
// Request ids start at 1 on each connection and grow by one per request; the
// target refuses any other. With a shared secret every header carries a tag
// (HMAC-SHA256/128 under the connection's key for its direction, see
// net/control_plane.hpp) over the header, the segment table (requests) or the
// message (replies) and the request id: only the engine that completed the
// handshake can issue requests or answer them. Payload bytes are not tagged
// (docs/reliability.md gives the threat model and the measured cost).
//
// Offsets in a request are offsets into the target's registered region
// `memId`; the target checks every range against that region before it
// touches memory. Anything malformed ends the connection (and is logged);
// a well-formed request that is refused gets an ERROR reply and the stream
// stays usable.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "io/net/auth.hpp"

namespace mori::io::tcp {

constexpr uint32_t kFrameMagic = 0x46434d54;  // "TMCF"
constexpr uint32_t kMaxSegmentsPerFrame = 16384;
constexpr uint64_t kMaxFrameBytes = 1ull << 30;
constexpr uint16_t kMaxReplyMessage = 1024;

enum class Op : uint8_t { Write = 1, Read = 2 };
enum class ReplyKind : uint8_t { Ack = 1, ReadData = 2, Error = 3 };
enum FrameFlags : uint8_t { kFlagNotify = 1 };

#pragma pack(push, 1)
struct RequestHeader {
  uint32_t magic;
  uint8_t op;
  uint8_t flags;
  uint16_t reserved;
  uint32_t memId;        // target's region
  uint32_t numSegments;
  uint64_t requestId;    // per connection, increasing
  uint64_t uid;          // transfer id for target-side notification
  uint64_t totalBytes;   // sum of segment sizes
  uint32_t notifyTotal;  // frames that make up the whole transfer
  uint32_t reserved2;
  uint8_t tag[16];       // zero without a secret
};

struct WireSegment {
  uint64_t offset;
  uint64_t size;
};

struct ReplyHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t code;  // StatusCode for errors
  uint16_t messageLen;
  uint64_t requestId;
  uint64_t dataBytes;
  uint8_t tag[16];  // zero without a secret
};
#pragma pack(pop)

static_assert(sizeof(RequestHeader) == 64, "RequestHeader layout");
static_assert(sizeof(ReplyHeader) == 40, "ReplyHeader layout");
constexpr size_t kRequestSigned = sizeof(RequestHeader) - 16;  // header bytes under the tag
constexpr size_t kReplySigned = sizeof(ReplyHeader) - 16;

// Structural validation of a request header; "" when acceptable.
inline std::string ValidateRequestHeader(const RequestHeader& h) {
  if (h.magic != kFrameMagic) return "bad frame magic";
  if (h.op != static_cast<uint8_t>(Op::Write) && h.op != static_cast<uint8_t>(Op::Read))
    return "unknown op " + std::to_string(h.op);
  if (h.flags & ~kFlagNotify) return "unknown flags";
  if (h.numSegments == 0 || h.numSegments > kMaxSegmentsPerFrame)
    return "segment count " + std::to_string(h.numSegments) + " outside [1, " +
           std::to_string(kMaxSegmentsPerFrame) + "]";
  if (h.totalBytes > kMaxFrameBytes)
    return "frame payload " + std::to_string(h.totalBytes) + " exceeds " + std::to_string(kMaxFrameBytes);
  if ((h.flags & kFlagNotify) && h.notifyTotal == 0) return "notification with zero parts";
  return "";
}

// Tag of a request (header + segment table) / a reply (header + message).
inline void SignRequest(net::FrameMac& mac, RequestHeader& h, const void* table, size_t tableBytes) {
  net::Tag t = mac.Sign(h.requestId, {{&h, kRequestSigned}, {table, tableBytes}});
  std::memcpy(h.tag, t.data(), t.size());
}
inline bool VerifyRequest(net::FrameMac& mac, const RequestHeader& h, const void* table, size_t tableBytes) {
  net::Tag t;
  std::memcpy(t.data(), h.tag, t.size());
  return mac.Verify(h.requestId, {{&h, kRequestSigned}, {table, tableBytes}}, t);
}
inline void SignReply(net::FrameMac& mac, ReplyHeader& h, const void* message, size_t messageBytes) {
  net::Tag t = mac.Sign(h.requestId, {{&h, kReplySigned}, {message, messageBytes}});
  std::memcpy(h.tag, t.data(), t.size());
}
inline bool VerifyReply(net::FrameMac& mac, const ReplyHeader& h, const void* message, size_t messageBytes) {
  net::Tag t;
  std::memcpy(t.data(), h.tag, t.size());
  return mac.Verify(h.requestId, {{&h, kReplySigned}, {message, messageBytes}}, t);
}

}  // namespace mori::io::tcp
