// One usable RDMA device port: its verbs context, protection domain, address
// (LID / GID) and limits, plus memory-region registration on it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/common.hpp"
#include "io/rdma/control_protocol.hpp"
#include "io/rdma/rdma_settings.hpp"
#include "io/rdma/verbs_api.hpp"

namespace mori::io::rdma {

class NicContext {
 public:
  // Takes ownership of `context`. Throws mori::BadState when the PD, the
  // completion channel or the port's address cannot be set up.
  NicContext(const VerbsApi& verbs, abi::ibv_context* context, std::string name, int port,
             const abi::ibv_device_attr& device, const abi::ibv_port_attr& portAttr, const RdmaSettings& settings);
  ~NicContext();
  NicContext(const NicContext&) = delete;
  NicContext& operator=(const NicContext&) = delete;

  const VerbsApi& verbs;
  abi::ibv_context* const context;
  abi::ibv_pd* pd = nullptr;
  abi::ibv_comp_channel* channel = nullptr;  // EVENT mode only
  const std::string name;
  const int port;
  uint8_t linkLayer = 0;
  abi::ibv_mtu activeMtu = abi::IBV_MTU_1024;
  uint16_t lid = 0;
  int gidIndex = -1;  // -1: no GRH (InfiniBand inside one subnet)
  std::array<uint8_t, 16> gid{};
  uint32_t maxMsgSize = 0;
  int maxQpWr = 0;
  int maxCqe = 0;
  int maxSge = 0;
  int maxRdAtomic = 0;      // reads this side may have outstanding as requester
  int maxDestRdAtomic = 0;  // reads it accepts as responder
  int numaNode = -1;

  // "<device>:<port>": how peers name this port on the control plane.
  std::string Id() const { return name + ":" + std::to_string(port); }
  PortAddress Address() const;
  std::string Describe() const;  // "mlx5_0:1 (RoCE, GID index 3)"
};
using NicPtr = std::shared_ptr<NicContext>;

// Opens every active port of every device that passes MORI_RDMA_DEVICES.
// Throws mori::BadState naming what is missing (no devices, all ports down,
// all filtered out) and what to do about it.
std::vector<NicPtr> OpenNics(const VerbsApi& verbs, const RdmaSettings& settings);

// A registered memory region on one NIC; deregistered on destruction or by
// Deregister() (when the engine deregisters the memory).
class MemoryRegion {
 public:
  // nullptr + *err (naming the cause and the fix) when registration fails.
  static std::shared_ptr<MemoryRegion> Register(const NicPtr& nic, const MemoryDesc& desc,
                                                const RdmaSettings& settings, std::string* err);
  ~MemoryRegion();
  void Deregister();

  uint64_t addr = 0;
  uint64_t length = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  bool viaDmabuf = false;
  NicPtr nic;

 private:
  std::mutex mu_;
  abi::ibv_mr* mr_ = nullptr;
};
using MrPtr = std::shared_ptr<MemoryRegion>;

// Registration of plain host (or peer-memory GPU) pages; exposed for the
// fallback path and for small internal buffers.
abi::ibv_mr* RegisterPlain(const NicContext& nic, void* addr, size_t length, int access, bool relaxed, int* err);

}  // namespace mori::io::rdma
