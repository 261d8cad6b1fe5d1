// Bindings of the MORI-EP handle. The typed Python API lives in
// mori_core.ops.dispatch_combine; this layer takes raw pointers and ints.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.hpp"
#include "ops/ep_handle.hpp"

namespace py = pybind11;
using mori::ep::EpHandle;
using mori::ep::EpHandleConfig;

namespace mori::bindings {

void RegisterOps(py::module_& m) {
  // A launch on an operator whose kernels reported a failure; the Python layer
  // re-raises it as mori_core.ops.EpOpError.
  auto& op_failure = py::register_exception<mori::ep::OpFailed>(m, "EpOpFailure", PyExc_RuntimeError);
  RegisterOpsFastCalls(m, op_failure.ptr());
  m.def(
      "ep_empty_kernel_launch",
      [](bool dispatch_sized_args, uintptr_t stream, bool driver_api) {
        mori::ep::LaunchEmptyKernel(dispatch_sized_args, driver_api, reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("dispatch_sized_args"), py::arg("stream"), py::arg("driver_api") = false,
      "Launch an empty kernel on the current device (benchmark floor of one launch's host cost).");
  py::class_<EpHandle>(m, "EpDispatchCombineHandle", "Buffers and kernel launches of one EP operator.")
      .def(py::init([](int rank, int world_size, int hidden_dim, int scale_dim, int scale_type_size,
                       int max_token_type_size, int max_num_inp_token_per_rank, int num_experts_per_rank,
                       int num_experts_per_token, int max_num_tokens_to_recv, int64_t timeout_ms) {
             EpHandleConfig c;
             c.rank = rank;
             c.world_size = world_size;
             c.hidden_dim = hidden_dim;
             c.scale_dim = scale_dim;
             c.scale_type_size = scale_type_size;
             c.max_token_type_size = max_token_type_size;
             c.max_num_inp_token_per_rank = max_num_inp_token_per_rank;
             c.num_experts_per_rank = num_experts_per_rank;
             c.num_experts_per_token = num_experts_per_token;
             c.max_num_tokens_to_recv = max_num_tokens_to_recv;
             c.timeout_ms = timeout_ms;
             return new EpHandle(c);
           }),
           py::kw_only(), py::arg("rank"), py::arg("world_size"), py::arg("hidden_dim"), py::arg("scale_dim"),
           py::arg("scale_type_size"), py::arg("max_token_type_size"), py::arg("max_num_inp_token_per_rank"),
           py::arg("num_experts_per_rank"), py::arg("num_experts_per_token"), py::arg("max_num_tokens_to_recv"),
           py::arg("timeout_ms"))
      // Launches go through _C.ep_launch_dispatch / ep_launch_combine (ops_fast_calls.cpp) with this address.
      .def_property_readonly("address", [](const EpHandle& h) { return reinterpret_cast<uintptr_t>(&h); })
      .def("buffers",
           [](const EpHandle& h) {
             py::dict d;
             for (const auto& [name, ptr, bytes] : h.Buffers()) d[py::str(name)] = py::make_tuple(ptr, bytes);
             return d;
           })
      .def("error_message", &EpHandle::ErrorMessage)
      .def("heap_offset", &EpHandle::HeapOffset)
      .def_property("timeout_ms", &EpHandle::timeout_ms, &EpHandle::set_timeout_ms)
      .def_property_readonly("sm_count", &EpHandle::sm_count)
      .def_property_readonly("arch_major", &EpHandle::arch_major)
      .def("close", &EpHandle::Close);
}

}  // namespace mori::bindings
