// mori_core._C: the single extension module. No libtorch: tensors arrive as
// integers (pointers, sizes, device ids, stream handles) from the Python layer.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.hpp"
#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "common/logging.hpp"
#include "ops/ep_profiler_phases.hpp"

#ifndef MORI_ENABLE_PROFILER
#define MORI_ENABLE_PROFILER 0
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "mori_core compiled core: MORI-IO transfer engine, symmetric memory and MORI-EP kernels";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mori::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const mori::NotFound& e) {
      PyErr_SetString(PyExc_LookupError, e.what());
    } catch (const mori::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def(
      "build_info",
      [] {
        py::dict d;
        d["gpu"] = mori::kBuiltWithGpu;
        d["gpu_lang"] = std::string(MORI_GPU_LANG_NAME);
        d["cuda_arch"] = std::string(MORI_CUDA_ARCH_NAME);
#ifdef MORI_HAS_SHMEM_BINDINGS
        d["shmem"] = true;
#else
        d["shmem"] = false;
#endif
#ifdef MORI_HAS_OPS_BINDINGS
        d["ops"] = true;
#else
        d["ops"] = false;
#endif
#ifdef MORI_HAS_CCL_BINDINGS
        d["ccl"] = true;
#else
        d["ccl"] = false;
#endif
        d["profiler"] = MORI_ENABLE_PROFILER != 0;
        py::list phases;
        for (const char* name : mori::ep::kEpProfilerPhaseNames) phases.append(name);
        d["ep_profiler_phases"] = phases;
        return d;
      },
      "What this build carries: GPU language, CUDA arch, and which areas were compiled.");
  m.def("gpu_device_count", &mori::GpuDeviceCount, "Visible GPUs (0 in CPU-only builds or without a driver).");
  m.def(
      "set_log_level", [](const std::string& level) { mori::log::SetLevel(mori::log::ParseLevel(level)); },
      py::arg("level"), "Set the core's log level: trace, debug, info, warning, error, critical or off.");

  mori::bindings::RegisterIo(m);
#ifdef MORI_HAS_RDMA_BINDINGS
  mori::bindings::RegisterRdmaTesting(m);
#endif
#ifdef MORI_HAS_XGMI_BINDINGS
  mori::bindings::RegisterXgmiTesting(m);
#endif
#ifdef MORI_HAS_SHMEM_BINDINGS
  mori::bindings::RegisterShmem(m);
#endif
#ifdef MORI_HAS_OPS_BINDINGS
  mori::bindings::RegisterOps(m);
#endif
#ifdef MORI_HAS_CCL_BINDINGS
  mori::bindings::RegisterCcl(m);
#endif
}
