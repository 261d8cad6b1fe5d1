// Which NIC is closest to a GPU, read from the PCI tree in sysfs.
//
// Both devices are resolved to their canonical sysfs paths
// (<root>/devices/pci0000:16/0000:16:02.0/0000:17:00.0/...) and compared by
// their deepest common ancestor, giving NCCL-style path classes:
//   PIX  both hang off the same PCIe switch (at most one switch between them)
//   PXB  several bridges apart, still below one root port
//   PHB  only the host bridge (root complex) in common
//   NODE different root complexes on the same NUMA node
//   SYS  different NUMA nodes (traffic crosses the CPU interconnect)
// The sysfs root is a parameter so the logic is testable on a fake tree.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace mori::io::rdma {

enum class PciPath : int { PIX = 0, PXB = 1, PHB = 2, NODE = 3, SYS = 4, UNKNOWN = 5 };
const char* ToString(PciPath p);

struct NicDistance {
  std::string nic;
  PciPath path = PciPath::UNKNOWN;
  int hops = 0;       // PCI links between the two devices (tie-breaker within a class)
  int numaNode = -1;  // of the NIC
};

class SysfsTopology {
 public:
  explicit SysfsTopology(std::string root = "/sys");

  // Canonical path components below <root>/devices, empty when unknown.
  std::vector<std::string> PathOfPciDevice(const std::string& busId) const;
  std::vector<std::string> PathOfIbDevice(const std::string& ibDevice) const;
  int NumaNodeOfPciDevice(const std::string& busId) const;
  int NumaNodeOfIbDevice(const std::string& ibDevice) const;

  // Distance from a GPU (PCI bus id such as "0000:1b:00.0") to each NIC.
  std::vector<NicDistance> Rank(const std::string& gpuBusId, const std::vector<std::string>& nics) const;

 private:
  std::vector<std::string> Canonical(const std::string& link) const;
  int ReadNuma(const std::string& path) const;
  std::string root_;
};

// "00000000:1B:00.0" / "0000:1b:00.0" -> "0000:1b:00.0"; "" when malformed.
std::string NormalizeBusId(const std::string& busId);

// Classifies two canonical paths (numa nodes break ties between roots).
PciPath Classify(const std::vector<std::string>& a, const std::vector<std::string>& b, int numaA, int numaB,
                 int* hops);

// Index into `ranked` of the closest NIC. Equally close NICs are shared out by
// `spread` (e.g. the GPU ordinal) so GPUs under one switch use different NICs.
size_t PickClosest(const std::vector<NicDistance>& ranked, int spread);

// Host memory: round robin (by `counter`) over the NICs on the memory's NUMA
// node, or over all NICs when none is local or the node is unknown (-1).
size_t PickForHostMemory(const std::vector<int>& nicNumaNodes, int memNumaNode, size_t counter);

}  // namespace mori::io::rdma
