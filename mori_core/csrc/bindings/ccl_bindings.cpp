// Bindings of MORI-CCL's native handle (mori_core.ccl builds the MORI API on top of it).
// Tensors arrive as addresses and byte counts; streams as integer handles.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.hpp"
#include "ccl/ccl_handle.hpp"
#include "ccl/link_probe.hpp"
#include "ccl/stream_memops.hpp"

namespace py = pybind11;
using namespace mori::ccl;

namespace mori::bindings {

void RegisterCcl(py::module_& m) {
  py::class_<CclHandle>(m, "CclHandle")
      .def(py::init([](int kind, int rank, int npes, uint64_t input_bytes, int red, int engine, uint64_t ce_min_bytes,
                       uint64_t oneshot_max_bytes, uint64_t ar_ce_min_bytes, int sm_blocks, int sm_threads,
                       int reduce_blocks, double timeout_s, bool ce_batch, bool ce_signal_copy, int ce_split,
                       uint64_t ce_piece_min_bytes) {
             Options o;
             o.engine = static_cast<Engine>(engine);
             o.ce_min_bytes = ce_min_bytes;
             o.oneshot_max_bytes = oneshot_max_bytes;
             o.ar_ce_min_bytes = ar_ce_min_bytes;
             o.sm_blocks = sm_blocks;
             o.sm_threads = sm_threads;
             o.reduce_blocks = reduce_blocks;
             o.timeout_s = timeout_s;
             o.ce_batch = ce_batch;
             o.ce_signal_copy = ce_signal_copy;
             o.ce_split = ce_split;
             o.ce_piece_min_bytes = ce_piece_min_bytes;
             py::gil_scoped_release release;
             return new CclHandle(static_cast<Kind>(kind), rank, npes, input_bytes, static_cast<RedType>(red), o);
           }),
           py::arg("kind"), py::arg("rank"), py::arg("npes"), py::arg("input_bytes"), py::arg("red"), py::arg("engine"),
           py::arg("ce_min_bytes"), py::arg("oneshot_max_bytes"), py::arg("ar_ce_min_bytes"), py::arg("sm_blocks"),
           py::arg("sm_threads"), py::arg("reduce_blocks"), py::arg("timeout_s"), py::arg("ce_batch"),
           py::arg("ce_signal_copy"), py::arg("ce_split") = 2, py::arg("ce_piece_min_bytes") = 1ull << 20)
      .def(
          "run",
          [](CclHandle& h, uintptr_t in, uintptr_t out, uint64_t nbytes, uintptr_t stream) {
            return static_cast<int>(h.Run(in, out, nbytes, stream));
          },
          py::arg("input"), py::arg("output"), py::arg("nbytes"), py::arg("stream"),
          "Enqueue one call; returns the path code that ran (see path_names).")
      .def(
          "start",
          [](CclHandle& h, uintptr_t in, uintptr_t out, uint64_t nbytes, uintptr_t stream) {
            return static_cast<int>(h.Start(in, out, nbytes, stream));
          },
          py::arg("input"), py::arg("output"), py::arg("nbytes"), py::arg("stream"))
      .def(
          "finish", [](CclHandle& h, uintptr_t stream) { return static_cast<int>(h.Finish(stream)); },
          py::arg("stream"))
      .def(
          "choose", [](const CclHandle& h, uint64_t nbytes) { return static_cast<int>(h.Choose(nbytes)); },
          py::arg("nbytes"))
      .def("close", &CclHandle::Close, py::call_guard<py::gil_scoped_release>(),
           "Collective: a last barrier with every peer, then free the heap buffers (idempotent).")
      .def("reset_flags", &CclHandle::ResetFlags, py::call_guard<py::gil_scoped_release>())
      .def("error", &CclHandle::Error, "'' while healthy, else what failed (names the peer).")
      .def_property_readonly("async_pending", &CclHandle::async_pending)
      .def_property_readonly("device", &CclHandle::device)
      .def_property_readonly("heap_bytes", &CclHandle::heap_bytes)
      .def_property_readonly("sync_offset", &CclHandle::sync_offset)
      .def_property_readonly("ce_available", &CclHandle::ce_available);
  py::list names;
  for (int p = 0; p <= static_cast<int>(Path::kCeAllReduce); ++p) names.append(PathName(static_cast<Path>(p)));
  m.attr("ccl_path_names") = names;
  m.def(
      "ccl_link_probe",
      [](int mode, uintptr_t src, const std::vector<uintptr_t>& targets, uintptr_t local_dst, uint64_t bytes,
         int blocks, int warps, int chunk, uintptr_t stream) {
        const LinkProbeArgs a{static_cast<LinkProbeMode>(mode), src, targets, local_dst, bytes, blocks, warps, chunk};
        LaunchLinkProbe(a, reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("mode"), py::arg("src"), py::arg("targets"), py::arg("local_dst"), py::arg("bytes"), py::arg("blocks"),
      py::arg("warps"), py::arg("chunk"), py::arg("stream"),
      "Enqueue one SM link-probe kernel (modes: 0 push_all, 1 push_each, 2 push_tma, 3 pull; link_probe.hpp).");
  m.def(
      "ccl_copy_engine_unavailable", [] { return StreamMemOpsUnavailable(); },
      "'' when the copy-engine path can run here (stream memory operations), else why not.");
}

}  // namespace mori::bindings
