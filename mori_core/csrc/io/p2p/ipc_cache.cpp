#include "io/p2p/ipc_cache.hpp"

#include <cstring>

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "common/logging.hpp"

namespace mori::io::p2p {

static_assert(sizeof(gpuIpcMemHandle_t) <= kIpcHandleBytes, "IPC handle does not fit the descriptor");

void ExportIpc(MemoryDesc& desc) {
  DeviceGuard g(desc.deviceId);
  void* base = nullptr;
  size_t size = 0;
  GpuAllocationRange(reinterpret_cast<void*>(desc.data), &base, &size);
  gpuIpcMemHandle_t h;
  MORI_GPU_CHECK(gpuIpcGetMemHandle(&h, base));
  std::memcpy(desc.ipcHandle.data(), &h, sizeof(h));
  desc.ipcOffset = desc.data - reinterpret_cast<uint64_t>(base);
}

IpcImportCache& IpcImportCache::Get() {
  static IpcImportCache* c = new IpcImportCache();  // never destroyed: the driver tears mappings down at exit
  return *c;
}

Mapping IpcImportCache::Map(const MemoryDesc& remote, int device, const void* owner) {
  Handle h = remote.ipcHandle;
  std::lock_guard<std::mutex> lock(mu_);
  auto key = std::make_pair(h, device);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    DeviceGuard g(device);
    gpuIpcMemHandle_t gh;
    std::memcpy(&gh, h.data(), sizeof(gh));
    void* ptr = nullptr;
    gpuError_t e = gpuIpcOpenMemHandle(&ptr, gh, gpuIpcMemLazyEnablePeerAccess);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();
      throw GpuError("cannot open the IPC handle of memory " + std::to_string(remote.id) + " of engine '" +
                     remote.engineKey + "' on device " + std::to_string(device) + ": " + gpuGetErrorString(e) +
                     " (the owner may have freed or deregistered it, or the descriptor comes from another "
                     "machine, boot or container without IPC access)");
    }
    void* base = nullptr;
    size_t size = 0;
    GpuAllocationRange(ptr, &base, &size);
    Entry entry;
    entry.mapping = {static_cast<uint8_t*>(ptr), static_cast<uint64_t>(size)};
    it = entries_.emplace(key, std::move(entry)).first;
    MORI_DEBUG("opened IPC mapping of engine '" << remote.engineKey << "' memory " << remote.id << " on device "
                                                << device << " (" << size << " bytes)");
  }
  it->second.users[{owner, remote.engineKey}] = 1;
  return it->second.mapping;
}

void IpcImportCache::Release(const void* owner, const std::string& engineKey) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto& users = it->second.users;
    for (auto u = users.begin(); u != users.end();) {
      if (u->first.first == owner && (engineKey.empty() || u->first.second == engineKey))
        u = users.erase(u);
      else
        ++u;
    }
    if (users.empty()) {
      DeviceGuard g(it->first.second);
      gpuError_t e = gpuIpcCloseMemHandle(it->second.mapping.base);
      if (e != gpuSuccess) {
        (void)gpuGetLastError();
        MORI_WARN("closing an IPC mapping failed: " << gpuGetErrorString(e));
      }
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace mori::io::p2p
