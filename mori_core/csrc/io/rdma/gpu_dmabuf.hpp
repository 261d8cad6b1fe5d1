// dma-buf export of GPU memory, for ibv_reg_dmabuf_mr (GPUDirect RDMA
// without the nvidia-peermem / amdgpu peer-memory kernel module).
#pragma once

#include <cstdint>
#include <string>

namespace mori::io::rdma {

struct GpuDmabuf {
  int fd = -1;          // owned by the caller (close it after registering)
  uint64_t offset = 0;  // where `ptr` lies inside the exported range
};

// Exports the page-aligned range that covers [ptr, ptr + size) on `device`.
// Returns fd -1 and the reason in *why when the build, driver or allocation
// does not support it. The caller's current device is left unchanged.
GpuDmabuf ExportGpuDmabuf(int device, uint64_t ptr, uint64_t size, std::string* why);

}  // namespace mori::io::rdma
