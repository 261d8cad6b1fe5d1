// CUDA/HIP IPC for registered GPU memory.
//
// Export: the handle names the *allocation* that contains the registered
// range (cudaIpcGetMemHandle only accepts allocation bases), and the range's
// offset inside it travels next to the handle in the MemoryDesc.
// Import: one mapping per (allocation handle, device) for the whole process,
// however many engines, descriptors or sub-allocations refer to it — keyed by
// the full handle bytes, never by (engine, memory id), which is how MORI ended
// up with wrong mappings under many handles. Mappings are reference counted by
// the (backend, remote engine) pairs that use them and closed when the last
// one is released.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "io/common.hpp"

namespace mori::io::p2p {

// Fills desc.ipcHandle / desc.ipcOffset for GPU memory. Throws GpuError.
void ExportIpc(MemoryDesc& desc);

struct Mapping {
  uint8_t* base = nullptr;  // start of the imported allocation in this process
  uint64_t allocSize = 0;   // its size, to bound-check descriptors against
};

class IpcImportCache {
 public:
  static IpcImportCache& Get();

  // Maps the allocation of `remote` on `device` for `owner` (a backend) and
  // remembers that `owner` uses it on behalf of remote engine remote.engineKey.
  // Throws GpuError with an actionable message for stale/foreign handles.
  Mapping Map(const MemoryDesc& remote, int device, const void* owner);
  // Drops `owner`'s uses of mappings from `engineKey` ("" = all engines).
  void Release(const void* owner, const std::string& engineKey);

 private:
  using Handle = std::array<uint8_t, kIpcHandleBytes>;
  struct Entry {
    Mapping mapping;
    std::map<std::pair<const void*, std::string>, int> users;
  };
  std::mutex mu_;
  std::map<std::pair<Handle, int>, Entry> entries_;
};

}  // namespace mori::io::p2p
