// Bindings of the symmetric heap (mori_core.shmem builds the MORI API and the
// TCPStore bootstrap on top of these). Names are prefixed `shmem_` in _C.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.hpp"
#include "common/env.hpp"
#include "common/gpu_runtime.hpp"
#include "shmem/shmem_state.hpp"

namespace py = pybind11;
using namespace mori::shmem;

namespace mori::bindings {
namespace {

py::dict InfoToDict(const PeerHeapInfo& i) {
  py::dict d;
  d["rank"] = i.rank;
  d["pid"] = i.pid;
  d["device"] = i.device;
  d["base"] = i.base;
  d["size"] = i.size;
  d["ipc_handle"] = py::bytes(i.ipc_handle);
  return d;
}

PeerHeapInfo DictToInfo(const py::dict& d) {
  PeerHeapInfo i;
  i.rank = d["rank"].cast<int>();
  i.pid = d["pid"].cast<int64_t>();
  i.device = d["device"].cast<int>();
  i.base = d["base"].cast<uint64_t>();
  i.size = d["size"].cast<uint64_t>();
  i.ipc_handle = d["ipc_handle"].cast<std::string>();
  return i;
}

}  // namespace

void RegisterShmem(py::module_& m) {
  m.def(
      "shmem_init_local",
      [](int rank, int world_size, int device, uint64_t heap_size) {
        return InfoToDict(InitLocal(rank, world_size, device, heap_size));
      },
      py::arg("rank"), py::arg("world_size"), py::arg("device"), py::arg("heap_size") = 0,
      "Allocate this rank's symmetric heap (size from MORI_SHMEM_HEAP_SIZE when heap_size is 0) and return the "
      "description peers need to map it.");
  m.def(
      "shmem_open_peers",
      [](const std::vector<py::dict>& peers) {
        std::vector<PeerHeapInfo> v;
        for (const auto& d : peers) v.push_back(DictToInfo(d));
        py::gil_scoped_release release;
        OpenPeers(v);
      },
      py::arg("peers"), "Map every peer's heap (descriptions indexed by rank).");
  m.def("shmem_finalize_local", &Finalize, "Unmap the peers and free this rank's heap.");
  m.def("shmem_initialized", &Initialized, "Whether the heap exists and the peers are mapped.");
  m.def("shmem_mype", [] { return Heap().rank(); });
  m.def("shmem_npes", [] { return Heap().world_size(); });
  m.def("shmem_device", [] { return Heap().device(); });
  m.def(
      "shmem_malloc",
      [](uint64_t size, uint64_t alignment) { return reinterpret_cast<uintptr_t>(Heap().Malloc(size, alignment)); },
      py::arg("size"), py::arg("alignment") = 256);
  m.def(
      "shmem_free", [](uintptr_t ptr) { Heap().Free(reinterpret_cast<void*>(ptr)); }, py::arg("ptr"));
  m.def(
      "shmem_ptr_p2p",
      [](uintptr_t ptr, int pe) { return reinterpret_cast<uintptr_t>(Heap().PeerPtr(reinterpret_cast<void*>(ptr), pe)); },
      py::arg("ptr"), py::arg("pe"), "Address of a heap pointer's twin in peer pe's heap (as mapped here).");
  m.def(
      "shmem_heap_info",
      [] {
        SymmetricHeap& h = Heap();
        py::dict d;
        d["base"] = reinterpret_cast<uintptr_t>(h.base());
        d["size"] = h.size();
        d["used"] = h.allocator().used();
        d["largest_free"] = h.allocator().LargestFree();
        d["peer_bases_device"] = reinterpret_cast<uintptr_t>(h.DevicePeerBases());
        return d;
      },
      "Heap base/size/usage and the device address of the peer-base table.");
  m.def(
      "parse_size", [](const std::string& text) { return env::ParseSize(text, "size"); }, py::arg("text"),
      "Parse a size such as '6G' or '512M' into bytes.");
  m.def(
      "shmem_memcpy",
      [](uintptr_t dst, uintptr_t src, uint64_t nbytes) {
        py::gil_scoped_release release;
        DeviceGuard g(Heap().device());
        MORI_GPU_CHECK(gpuMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                                 gpuMemcpyDefault));
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      "Synchronous copy between any addresses this GPU can reach (local, peer-mapped heap, host).");
  m.def(
      "device_synchronize",
      [](int device) {
        py::gil_scoped_release release;
        DeviceGuard g(device);
        MORI_GPU_CHECK(gpuDeviceSynchronize());
      },
      py::arg("device"));
}

}  // namespace mori::bindings
