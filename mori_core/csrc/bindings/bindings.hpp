// Registration entry points of the extension's areas.
#pragma once

#include <pybind11/pybind11.h>

namespace mori::bindings {

void RegisterIo(pybind11::module_& m);
#ifdef MORI_HAS_RDMA_BINDINGS
void RegisterRdmaTesting(pybind11::module_& m);
#endif
#ifdef MORI_HAS_XGMI_BINDINGS
void RegisterXgmiTesting(pybind11::module_& m);
#endif
#ifdef MORI_HAS_SHMEM_BINDINGS
void RegisterShmem(pybind11::module_& m);
#endif
#ifdef MORI_HAS_CCL_BINDINGS
void RegisterCcl(pybind11::module_& m);
#endif
#ifdef MORI_HAS_OPS_BINDINGS
void RegisterOps(pybind11::module_& m);
// Dispatch/combine launch functions that skip pybind11's argument loader.
void RegisterOpsFastCalls(pybind11::module_& m, PyObject* op_failure_type);
#endif

}  // namespace mori::bindings
