#include "io/rdma/pci_topology.hpp"

#include <climits>
#include <cstdlib>
#include <fstream>
#include <algorithm>
#include <cctype>

namespace mori::io::rdma {
namespace {

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t p = s.find(sep, start);
    if (p == std::string::npos) p = s.size();
    if (p > start) out.push_back(s.substr(start, p - start));
    start = p + 1;
  }
  return out;
}

bool IsHex(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isxdigit(c); });
}

}  // namespace

const char* ToString(PciPath p) {
  switch (p) {
    case PciPath::PIX: return "PIX";
    case PciPath::PXB: return "PXB";
    case PciPath::PHB: return "PHB";
    case PciPath::NODE: return "NODE";
    case PciPath::SYS: return "SYS";
    default: return "UNKNOWN";
  }
}

std::string NormalizeBusId(const std::string& busId) {
  // domain:bus:device.function
  std::string s;
  for (char c : busId) s.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  auto parts = Split(s, ':');
  if (parts.size() != 3) return "";
  std::string domain = parts[0];
  if (domain.size() > 4 && IsHex(domain) && std::all_of(domain.begin(), domain.end() - 4, [](char c) { return c == '0'; }))
    domain = domain.substr(domain.size() - 4);
  auto df = Split(parts[2], '.');
  if (domain.size() != 4 || !IsHex(domain) || parts[1].size() != 2 || !IsHex(parts[1]) || df.size() != 2 ||
      df[0].size() != 2 || !IsHex(df[0]) || df[1].size() != 1 || !IsHex(df[1]))
    return "";
  return domain + ":" + parts[1] + ":" + parts[2];
}

SysfsTopology::SysfsTopology(std::string root) : root_(std::move(root)) {
  while (root_.size() > 1 && root_.back() == '/') root_.pop_back();
}

std::vector<std::string> SysfsTopology::Canonical(const std::string& link) const {
  char buf[PATH_MAX];
  char rootBuf[PATH_MAX];
  if (!realpath(link.c_str(), buf) || !realpath(root_.c_str(), rootBuf)) return {};
  std::string path(buf), prefix = std::string(rootBuf) + "/devices/";
  if (path.compare(0, prefix.size(), prefix) != 0) return {};
  auto parts = Split(path.substr(prefix.size()), '/');
  // Only PCI devices have a place in the tree; virtual devices (e.g. soft-RoCE) do not.
  if (parts.empty() || parts[0].compare(0, 3, "pci") != 0) return {};
  return parts;
}

int SysfsTopology::ReadNuma(const std::string& path) const {
  std::ifstream f(path);
  int node = -1;
  if (!(f >> node)) return -1;
  return node < 0 ? -1 : node;
}

std::vector<std::string> SysfsTopology::PathOfPciDevice(const std::string& busId) const {
  std::string id = NormalizeBusId(busId);
  if (id.empty()) return {};
  return Canonical(root_ + "/bus/pci/devices/" + id);
}

std::vector<std::string> SysfsTopology::PathOfIbDevice(const std::string& ibDevice) const {
  return Canonical(root_ + "/class/infiniband/" + ibDevice + "/device");
}

int SysfsTopology::NumaNodeOfPciDevice(const std::string& busId) const {
  std::string id = NormalizeBusId(busId);
  return id.empty() ? -1 : ReadNuma(root_ + "/bus/pci/devices/" + id + "/numa_node");
}

int SysfsTopology::NumaNodeOfIbDevice(const std::string& ibDevice) const {
  return ReadNuma(root_ + "/class/infiniband/" + ibDevice + "/device/numa_node");
}

PciPath Classify(const std::vector<std::string>& a, const std::vector<std::string>& b, int numaA, int numaB,
                 int* hops) {
  *hops = 0;
  if (a.empty() || b.empty()) return PciPath::UNKNOWN;
  size_t common = 0;
  while (common < a.size() && common < b.size() && a[common] == b[common]) ++common;
  int below = static_cast<int>(a.size() - common), belowB = static_cast<int>(b.size() - common);
  *hops = below + belowB;
  if (common == 0) return (numaA >= 0 && numaA == numaB) ? PciPath::NODE : PciPath::SYS;
  if (common == 1) return PciPath::PHB;  // only the host bridge "pciDDDD:BB" is shared
  // The deepest shared component is a bridge; one switch between them means
  // each device sits at most two levels (downstream port, device) below it.
  return (below <= 2 && belowB <= 2) ? PciPath::PIX : PciPath::PXB;
}

std::vector<NicDistance> SysfsTopology::Rank(const std::string& gpuBusId, const std::vector<std::string>& nics) const {
  std::vector<std::string> gpu = PathOfPciDevice(gpuBusId);
  int gpuNuma = NumaNodeOfPciDevice(gpuBusId);
  std::vector<NicDistance> out;
  out.reserve(nics.size());
  for (const auto& n : nics) {
    NicDistance d;
    d.nic = n;
    d.numaNode = NumaNodeOfIbDevice(n);
    d.path = Classify(gpu, PathOfIbDevice(n), gpuNuma, d.numaNode, &d.hops);
    out.push_back(std::move(d));
  }
  return out;
}

size_t PickClosest(const std::vector<NicDistance>& ranked, int spread) {
  if (ranked.empty()) return 0;
  auto key = [](const NicDistance& d) { return std::make_pair(static_cast<int>(d.path), d.hops); };
  auto best = key(ranked[0]);
  for (const auto& d : ranked) best = std::min(best, key(d));
  std::vector<size_t> ties;
  for (size_t i = 0; i < ranked.size(); ++i)
    if (key(ranked[i]) == best) ties.push_back(i);
  size_t s = spread < 0 ? 0 : static_cast<size_t>(spread);
  return ties[s % ties.size()];
}

size_t PickForHostMemory(const std::vector<int>& nicNumaNodes, int memNumaNode, size_t counter) {
  if (nicNumaNodes.empty()) return 0;
  std::vector<size_t> local;
  if (memNumaNode >= 0)
    for (size_t i = 0; i < nicNumaNodes.size(); ++i)
      if (nicNumaNodes[i] == memNumaNode) local.push_back(i);
  if (local.empty()) return counter % nicNumaNodes.size();
  return local[counter % local.size()];
}

}  // namespace mori::io::rdma
