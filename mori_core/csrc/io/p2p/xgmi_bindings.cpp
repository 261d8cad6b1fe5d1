// mori_core._C._xgmi_testing: the XGMI backend's scatter-copy kernel on a
// caller's stream, so the IO benchmark can time the kernel alone (CUDA events
// around it) beside the whole transfer, and sweep its shape. GPU builds only.
// Internal: not part of the public API.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.hpp"
#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "io/p2p/copy_proxy.hpp"
#include "io/p2p/scatter_copy.hpp"

namespace py = pybind11;
using namespace mori::io::p2p;

namespace mori::bindings {

void RegisterXgmiTesting(py::module_& m) {
  py::module_ t = m.def_submodule("_xgmi_testing", "XGMI backend internals for the IO benchmark (not public API).");
  t.def(
      "scatter_copy",
      [](const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs, const std::vector<uint64_t>& sizes,
         uint64_t stream, uint32_t pieceBytes, uint32_t threads) {
        if (dsts.size() != srcs.size() || dsts.size() != sizes.size())
          throw InvalidArgument("scatter_copy: dsts, srcs and sizes must have the same length");
        std::vector<CopySeg> segs(dsts.size());
        for (size_t i = 0; i < segs.size(); ++i) segs[i] = {srcs[i], dsts[i], sizes[i]};
        ScatterShape shape{pieceBytes, threads};
        py::gil_scoped_release nogil;
        LaunchScatterCopy(segs.data(), segs.size(), shape, KernelSignal{}, reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("stream"), py::arg("piece_bytes") = 16384,
      py::arg("threads") = 256,
      "Enqueue the scatter-copy kernel on `stream` (a cudaStream_t as int; its device must be current).");
  t.def(
      "enable_peer_access",
      [](int device, int peer) {
        DeviceGuard g(device);
        gpuError_t e = gpuDeviceEnablePeerAccess(peer, 0);
        if (e != gpuSuccess && e != gpuErrorPeerAccessAlreadyEnabled) MORI_GPU_CHECK(e);
        (void)gpuGetLastError();
      },
      py::arg("device"), py::arg("peer"), "Let kernels on `device` access memory of `peer`.");
  t.def("pinned_ping_pong_us", &PinnedPingPongUs, py::arg("device"), py::arg("iters"),
        py::call_guard<py::gil_scoped_release>(),
        "Host -> GPU -> host round trips through pinned memory (us each): the floor of the copy proxy's latency.");
}

}  // namespace mori::bindings
