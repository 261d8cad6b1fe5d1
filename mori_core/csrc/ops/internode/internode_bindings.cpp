// mori_core._internode: the inter-node EP kernels and their network engine
// (NVSHMEM). A separate extension module, built only when CMake finds NVSHMEM
// and imported lazily (mori_core.ops.internode), so mori_core._C and the wheel
// work without NVSHMEM. Tensors cross as raw pointers (no libtorch).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/error.hpp"
#include "ops/internode/internode_fast_calls.hpp"
#include "ops/internode/internode_handle.hpp"
#include "ops/internode/nvshmem_runtime.hpp"

namespace py = pybind11;
using mori::ep::inter::InterHandleConfig;
using mori::ep::inter::InterNodeHandle;
namespace net = mori::ep::inter::net;

namespace {

InterHandleConfig MakeConfig(const py::dict& d) {
  InterHandleConfig c;
  c.rank = d["rank"].cast<int>();
  c.world_size = d["world_size"].cast<int>();
  c.gpu_per_node = d["gpu_per_node"].cast<int>();
  c.hidden_dim = d["hidden_dim"].cast<int>();
  c.scale_dim = d["scale_dim"].cast<int>();
  c.scale_type_size = d["scale_type_size"].cast<int>();
  c.max_token_type_size = d["max_token_type_size"].cast<int>();
  c.max_num_inp_token_per_rank = d["max_num_inp_token_per_rank"].cast<int>();
  c.num_experts_per_rank = d["num_experts_per_rank"].cast<int>();
  c.num_experts_per_token = d["num_experts_per_token"].cast<int>();
  c.max_num_tokens_to_recv = d["max_num_tokens_to_recv"].cast<int>();
  c.timeout_ms = d["timeout_ms"].cast<int64_t>();
  return c;
}

}  // namespace

PYBIND11_MODULE(_internode, m) {
  m.doc() = "mori_core inter-node EP kernels (NVSHMEM network engine + NVLink forwarding)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mori::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const mori::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("nvshmem_unique_id", [] { return py::bytes(net::UniqueId()); },
        "Create NVSHMEM's unique-id bootstrap on this rank; returns its 128 bytes.");
  m.def(
      "nvshmem_init",
      [](int rank, int world, const py::bytes& uid, int device) {
        std::string id = uid;
        py::gil_scoped_release release;
        net::Init(rank, world, id, device);
      },
      py::arg("rank"), py::arg("world_size"), py::arg("unique_id"), py::arg("device"),
      "Collective NVSHMEM initialisation with a unique id from nvshmem_unique_id().");
  m.def("nvshmem_initialized", &net::Initialized);
  m.def("nvshmem_finalize", [] {
    py::gil_scoped_release release;
    net::Finalize();
  });
  m.def("nvshmem_my_pe", &net::MyPe);
  m.def("nvshmem_n_pes", &net::NPes);
  m.def(
      "nvshmem_self_test",
      [](int peer, size_t bytes, int64_t timeout_ms) {
        py::gil_scoped_release release;
        return net::SelfTest(peer, bytes, timeout_ms);
      },
      py::arg("peer"), py::arg("bytes"), py::arg("timeout_ms") = 10000,
      "Collective bring-up check: put-with-signal to `peer`, bounded wait for its, verify the bytes.");
  // Registered after the generic translator: pybind11 tries the last-registered first, and an
  // op failure must not become a plain RuntimeError.
  auto& op_failure =
      py::register_exception<mori::ep::inter::NetOpFailed>(m, "InterNodeOpFailure", PyExc_RuntimeError);
  mori::ep::inter::RegisterFastCalls(m, op_failure.ptr());
  // Names of the phase timestamps (index = PhasePoint) and the rounds the ring keeps.
  m.attr("PHASE_POINTS") = py::make_tuple(
      "disp_send_start", "disp_send_copied", "disp_send_signalled", "disp_recv_start", "disp_recv_arrived",
      "disp_recv_forwarded", "disp_recv_done", "comb_prep_start", "comb_prep_done", "comb_send_start",
      "comb_send_ready", "comb_send_copied", "comb_send_signalled", "comb_recv_start", "comb_recv_arrived",
      "comb_recv_done");
  m.attr("PHASE_RING") = mori::ep::inter::kPhaseRing;
  m.def(
      "ipc_bytes", [](const py::dict& cfg) { return InterNodeHandle::IpcBytes(MakeConfig(cfg)); }, py::arg("config"),
      "Bytes of the node-local symmetric block an InterNodeHandle with this config needs.");

  py::class_<InterNodeHandle>(m, "InterNodeHandle", "Buffers and kernel launches of one inter-node EP operator.")
      .def(py::init([](const py::dict& cfg, uintptr_t ipc_block, const std::vector<int64_t>& deltas, int device,
                       bool force_put) {
             InterHandleConfig c = MakeConfig(cfg);
             py::gil_scoped_release release;
             return new InterNodeHandle(c, ipc_block, deltas, device, force_put);
           }),
           py::arg("config"), py::arg("ipc_block"), py::arg("local_peer_delta"), py::arg("device"),
           py::arg("force_put") = false)
      .def_property_readonly("address", [](const InterNodeHandle& h) { return reinterpret_cast<uintptr_t>(&h); },
                             "Address for launch_dispatch / launch_combine (valid while the handle lives).")
      .def("dispatch", &InterNodeHandle::Dispatch, py::arg("input"), py::arg("row_bytes"), py::arg("num_tokens"),
           py::arg("weights"), py::arg("scales"), py::arg("indices"), py::arg("block_num"), py::arg("warp_per_block"),
           py::arg("rdma_block_num"), py::arg("finish"), py::arg("stream"))
      .def("dispatch_recv", &InterNodeHandle::DispatchRecv, py::arg("block_num"), py::arg("warp_per_block"),
           py::arg("stream"))
      .def("combine", &InterNodeHandle::Combine, py::arg("input"), py::arg("dtype"), py::arg("hidden_dim"),
           py::arg("input_rows"), py::arg("weights"), py::arg("weight_rows"), py::arg("indices"),
           py::arg("num_tokens"), py::arg("push"), py::arg("block_num"), py::arg("warp_per_block"), py::arg("finish"),
           py::arg("stream"))
      .def("combine_recv", &InterNodeHandle::CombineRecv, py::arg("block_num"), py::arg("warp_per_block"),
           py::arg("stream"))
      .def_property("put_rows", &InterNodeHandle::put_rows, &InterNodeHandle::set_put_rows,
                    "Network rows per NVSHMEM put on the put path, in [1, max_num_inp_token_per_rank].")
      .def_property_readonly("direct_peers", &InterNodeHandle::direct_peers,
                             "Peer nodes written with plain stores (their NVSHMEM heap is load/store-reachable).")
      .def_property_readonly("put_peers", &InterNodeHandle::put_peers, "Peer nodes reached by NVSHMEM puts.")
      .def("phase_ring",
           [](const InterNodeHandle& h) {
             auto r = h.PhaseRing();
             return py::make_tuple(r.first, r.second);
           },
           "(device pointer, bytes) of the int64 phase timestamps [2][ring][points] (dispatch, combine).")
      .def("buffers",
           [](const InterNodeHandle& h) {
             py::dict d;
             for (const auto& [name, ptr, bytes] : h.Buffers()) d[py::str(name)] = py::make_tuple(ptr, bytes);
             return d;
           })
      .def("error_message", &InterNodeHandle::ErrorMessage)
      .def_property("timeout_ms", &InterNodeHandle::timeout_ms, &InterNodeHandle::set_timeout_ms)
      .def_property_readonly("uses_network", &InterNodeHandle::uses_network)
      .def("close", [](InterNodeHandle& h) {
        py::gil_scoped_release release;
        h.Close();
      });
}
