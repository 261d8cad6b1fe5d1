#include "io/rdma/roce_gid.hpp"

#include <cctype>
#include <cstdio>
#include <fstream>

namespace mori::io::rdma {
namespace {

std::string ReadLine(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (!std::getline(f, line)) return "";
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
  return line;
}

int Rank(const GidEntry& e) {
  // Lower is better; -1 = unusable.
  if (IsZeroGid(e.gid)) return -1;
  switch (e.type) {
    case GidType::RoceV2:
      if (IsIpv4MappedGid(e.gid)) return 0;
      if (!IsLinkLocalGid(e.gid)) return 1;
      return 2;
    case GidType::RoceV1:
      return 3;
    default:
      // Type unknown (no sysfs in the container): usable, least preferred,
      // still IPv4-mapped before global before link-local.
      if (IsIpv4MappedGid(e.gid)) return 4;
      if (!IsLinkLocalGid(e.gid)) return 5;
      return 6;
  }
}

}  // namespace

bool IsZeroGid(const std::array<uint8_t, 16>& g) {
  for (uint8_t b : g)
    if (b) return false;
  return true;
}

bool IsIpv4MappedGid(const std::array<uint8_t, 16>& g) {
  for (int i = 0; i < 10; ++i)
    if (g[i]) return false;
  return g[10] == 0xff && g[11] == 0xff;
}

bool IsLinkLocalGid(const std::array<uint8_t, 16>& g) { return g[0] == 0xfe && (g[1] & 0xc0) == 0x80; }

bool ParseGid(const std::string& text, std::array<uint8_t, 16>* out) {
  // Eight groups of four hex digits separated by ':' (the sysfs format).
  if (text.size() != 39) return false;
  for (int grp = 0; grp < 8; ++grp) {
    if (grp > 0 && text[grp * 5 - 1] != ':') return false;
    unsigned v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = text[grp * 5 + k];
      if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
      v = v * 16 + static_cast<unsigned>(std::isdigit(static_cast<unsigned char>(c)) ? c - '0' : (std::tolower(c) - 'a' + 10));
    }
    (*out)[grp * 2] = static_cast<uint8_t>(v >> 8);
    (*out)[grp * 2 + 1] = static_cast<uint8_t>(v & 0xff);
  }
  return true;
}

std::string FormatGid(const std::array<uint8_t, 16>& g) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", g[0],
                g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15]);
  return buf;
}

std::vector<GidEntry> ReadGidTable(const std::string& sysfsRoot, const std::string& device, int port,
                                   int maxEntries) {
  std::vector<GidEntry> out;
  const std::string base = sysfsRoot + "/class/infiniband/" + device + "/ports/" + std::to_string(port);
  for (int i = 0; i < maxEntries; ++i) {
    GidEntry e;
    e.index = i;
    if (!ParseGid(ReadLine(base + "/gids/" + std::to_string(i)), &e.gid) || IsZeroGid(e.gid)) continue;
    std::string type = ReadLine(base + "/gid_attrs/types/" + std::to_string(i));
    for (auto& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (type.find("v2") != std::string::npos) e.type = GidType::RoceV2;
    else if (type.find("roce") != std::string::npos) e.type = GidType::RoceV1;  // "IB/RoCE v1"
    out.push_back(e);
  }
  return out;
}

int ChooseGidIndex(const std::vector<GidEntry>& entries) {
  int best = -1, bestRank = 1 << 30;
  for (const auto& e : entries) {
    int r = Rank(e);
    if (r >= 0 && r < bestRank) {
      bestRank = r;
      best = e.index;
    }
  }
  return best;
}

}  // namespace mori::io::rdma
