// GID index choice for RoCE ports (MORI_IB_GID_INDEX overrides it).
//
// RoCE addresses a peer through a GID table entry of the local port. The
// table holds one entry per (IP address, RoCE version) of the netdev; a wrong
// choice connects nothing (the peer never answers, the QP times out). We take,
// in order: RoCE v2 with an IPv4-mapped address, RoCE v2 with a global IPv6
// address, RoCE v2 link-local, then RoCE v1 — the order NCCL and MORI use;
// entries of unknown type (no sysfs) come last, IPv4-mapped first.
// Types come from sysfs (<root>/class/infiniband/<dev>/ports/<port>/gid_attrs).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace mori::io::rdma {

enum class GidType { Unknown, RoceV1, RoceV2 };

struct GidEntry {
  int index = 0;
  std::array<uint8_t, 16> gid{};
  GidType type = GidType::Unknown;
};

bool IsZeroGid(const std::array<uint8_t, 16>& g);
bool IsIpv4MappedGid(const std::array<uint8_t, 16>& g);
bool IsLinkLocalGid(const std::array<uint8_t, 16>& g);
// "fe80:0000:0000:0000:0250:56ff:feaa:bbcc" -> bytes; false when malformed.
bool ParseGid(const std::string& text, std::array<uint8_t, 16>* out);
std::string FormatGid(const std::array<uint8_t, 16>& g);

// Reads the non-empty entries of a port's GID table from sysfs (up to maxEntries).
std::vector<GidEntry> ReadGidTable(const std::string& sysfsRoot, const std::string& device, int port,
                                   int maxEntries);

// Best entry by the order above; -1 when no entry is usable.
int ChooseGidIndex(const std::vector<GidEntry>& entries);

}  // namespace mori::io::rdma
