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
             // EpOpConfig's fields in declaration order (gpu_per_node 0: IntraNode).
             const EpHandleConfig c{rank, world_size, 0, hidden_dim, scale_dim, scale_type_size, max_token_type_size,
                                    max_num_inp_token_per_rank, num_experts_per_rank, num_experts_per_token,
                                    max_num_tokens_to_recv, timeout_ms};
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
      .def("close", &EpHandle::Close)
      // ---- FP8 combine, standard-MoE layout, profiler (issue #15) ----
      .def("set_combine_quant", &EpHandle::SetCombineQuant, py::arg("quant"))
      .def_property_readonly("combine_quant", &EpHandle::combine_quant)
      .def("ensure_standard_moe", &EpHandle::EnsureStandardMoe)
      .def("launch_dispatch_standard_moe", &EpHandle::DispatchStandardMoe, py::arg("input"), py::arg("row_bytes"),
           py::arg("num_tokens"), py::arg("weights"), py::arg("scales"), py::arg("indices"), py::arg("block_num"),
           py::arg("warp_per_block"), py::arg("stream"))
      .def("launch_convert_dispatch_output", &EpHandle::ConvertDispatchOutput, py::arg("x"), py::arg("row_bytes"),
           py::arg("x_rows"), py::arg("ids"), py::arg("block_num"), py::arg("warp_per_block"), py::arg("stream"))
      .def("launch_convert_combine_input", &EpHandle::ConvertCombineInput, py::arg("packed"), py::arg("dtype"),
           py::arg("hidden_dim"), py::arg("block_num"), py::arg("warp_per_block"), py::arg("stream"))
      .def("launch_combine_standard_moe", &EpHandle::CombineStandardMoe, py::arg("packed"), py::arg("dtype"),
           py::arg("hidden_dim"), py::arg("indices"), py::arg("num_tokens"), py::arg("block_num"),
           py::arg("warp_per_block"), py::arg("stream"))
      .def("standard_moe_buffers",
           [](const EpHandle& h) {
             py::dict d;
             for (const auto& [name, ptr, bytes] : h.StandardMoeBuffers()) d[py::str(name)] = py::make_tuple(ptr, bytes);
             return d;
           })
      .def("debug_time_buf", &EpHandle::DebugTimeBuf,
           "(device pointer, bytes) of the kernel profiler's int64 event buffer; (0, 0) without MORI_ENABLE_PROFILER")
      .def("reset_debug_time_buf", &EpHandle::ResetDebugTimeBuf)
      .def_property_readonly_static("profiler_enabled", [](py::object) { return EpHandle::ProfilerEnabled(); });
}

}  // namespace mori::bindings
