// Messages of the RDMA backend on the engine's control plane
// (net::Channel::RdmaControl, after the authenticated handshake).
//
// Each message travels as u32 length + body; the body starts with a magic,
// a version and a type byte. Every field has a bound and every decoder
// rejects truncated, oversized or unknown input with mori::InvalidArgument
// (the server then drops the connection). One request, one reply:
//   Hello      -> HelloReply     which link layers the target's NICs speak
//   GetMemory  -> MemoryInfo     the NIC, address, size and rkey of a region
//                                (the target registers it on first request)
//   Connect    -> Connected      RC QP addresses for a group of QPs
//   Release    -> Released       the initiator no longer uses these groups
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "io/common.hpp"

namespace mori::io::rdma {

constexpr uint32_t kControlMagic = 0x41445243;  // "CRDA"
constexpr uint16_t kControlVersion = 1;
constexpr uint32_t kMaxControlBytes = 64 * 1024;
constexpr size_t kMaxNicNameBytes = 64;
constexpr size_t kMaxControlTextBytes = 1024;
constexpr size_t kMaxQpsPerGroup = 64;
constexpr size_t kMaxReleasePerMessage = 1024;

enum class MsgType : uint8_t {
  Hello = 1,
  HelloReply = 2,
  GetMemory = 3,
  MemoryInfo = 4,
  Connect = 5,
  Connected = 6,
  Release = 7,
  Released = 8,
};

// Where a NIC port can be reached (one side of an RC connection).
struct PortAddress {
  std::string nic;
  uint8_t port = 1;
  uint8_t linkLayer = 0;    // IBV_LINK_LAYER_*
  uint8_t activeMtu = 0;    // ibv_mtu enum
  uint8_t maxRdAtomic = 0;  // outstanding RDMA reads this side accepts
  uint16_t lid = 0;
  uint8_t useGrh = 0;
  std::array<uint8_t, 16> gid{};
  uint32_t maxMsgSize = 0;
};

struct QpAddress {
  uint32_t qpn = 0;
  uint32_t psn = 0;
};

struct HelloRequest {};
struct HelloReply {
  uint8_t linkLayerMask = 0;  // bit (1 << IBV_LINK_LAYER_*) per link layer present
  uint16_t numNics = 0;
};
struct GetMemoryRequest {
  uint32_t memId = 0;
};
struct MemoryInfoReply {
  StatusCode code = StatusCode::SUCCESS;
  std::string message;
  std::string nic;
  uint64_t addr = 0;
  uint64_t size = 0;
  uint32_t rkey = 0;
};
struct ConnectRequest {
  uint64_t groupId = 0;
  std::string targetNic;
  PortAddress initiator;
  std::vector<QpAddress> qps;
};
struct ConnectedReply {
  StatusCode code = StatusCode::SUCCESS;
  std::string message;
  PortAddress target;
  std::vector<QpAddress> qps;
};
struct ReleaseRequest {
  std::vector<uint64_t> groupIds;
};
struct ReleasedReply {};

std::vector<uint8_t> Encode(const HelloRequest&);
std::vector<uint8_t> Encode(const HelloReply&);
std::vector<uint8_t> Encode(const GetMemoryRequest&);
std::vector<uint8_t> Encode(const MemoryInfoReply&);
std::vector<uint8_t> Encode(const ConnectRequest&);
std::vector<uint8_t> Encode(const ConnectedReply&);
std::vector<uint8_t> Encode(const ReleaseRequest&);
std::vector<uint8_t> Encode(const ReleasedReply&);

// Validates the header and returns the type.
MsgType PeekType(const std::vector<uint8_t>& body);
HelloReply DecodeHelloReply(const std::vector<uint8_t>& body);
GetMemoryRequest DecodeGetMemory(const std::vector<uint8_t>& body);
MemoryInfoReply DecodeMemoryInfo(const std::vector<uint8_t>& body);
ConnectRequest DecodeConnect(const std::vector<uint8_t>& body);
ConnectedReply DecodeConnected(const std::vector<uint8_t>& body);
ReleaseRequest DecodeRelease(const std::vector<uint8_t>& body);
void DecodeReleased(const std::vector<uint8_t>& body);

}  // namespace mori::io::rdma
