// MORI_RDMA_DEVICES: which RDMA devices (and ports) the backend may use.
//
//   ""                      every device with an active port
//   "mlx5_0,mlx5_1"         only these devices (any active port)
//   "mlx5_0:1,mlx5_1:1"     only port 1 of these devices
//   "^mlx5_2,mlx5_3:2"      every device except mlx5_2 and port 2 of mlx5_3
//
// Names match exactly (no prefix matching, unlike NCCL_IB_HCA, so that
// "mlx5_1" never also selects "mlx5_10").
#pragma once

#include <string>
#include <vector>

namespace mori::io::rdma {

struct DeviceFilterEntry {
  std::string name;
  int port = 0;  // 0 = every port
};

struct DeviceFilter {
  bool exclude = false;
  std::vector<DeviceFilterEntry> entries;

  bool Empty() const { return entries.empty(); }
  // Whether port `port` of device `name` may be used.
  bool Accepts(const std::string& name, int port) const;
  // Include-list entries that name none of `present` (for a warning).
  std::vector<std::string> UnmatchedIncludes(const std::vector<std::string>& present) const;
};

// Throws mori::InvalidArgument naming `what` and the offending entry.
DeviceFilter ParseDeviceFilter(const std::string& spec, const char* what = "MORI_RDMA_DEVICES");

}  // namespace mori::io::rdma
