// Registers the inter-node module's METH_FASTCALL launch entry points
// (launch_dispatch, launch_combine; see internode_fast_calls.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace mori::ep::inter {

// `op_failure_type`: the Python exception raised when an earlier kernel of the op failed.
void RegisterFastCalls(pybind11::module_& m, PyObject* op_failure_type);

}  // namespace mori::ep::inter
