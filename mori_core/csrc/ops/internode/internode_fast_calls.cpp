// Hot-path entry points of the inter-node handle: dispatch and combine (send
// half, and with `finish` the receive half too) as plain CPython
// METH_FASTCALL functions taking ints, like _C's ep_launch_dispatch: pybind11's
// generic loader costs a sizeable share of an eager call's few microseconds of
// host time for a dozen arguments. Exceptions are translated as the module's
// pybind11 translators do.
//
// The first argument is the handle's address (InterNodeHandle.address); the
// Python engine keeps the handle alive and passes 0 after close(), refused here.
#include "ops/internode/internode_fast_calls.hpp"

#include <Python.h>

#include <cstdint>
#include <exception>

#include "common/error.hpp"
#include "ops/internode/internode_handle.hpp"

namespace mori::ep::inter {
namespace {

PyObject* g_op_failure_type = nullptr;  // mori_core._internode.InterNodeOpFailure

// Sets the Python error for the C++ exception in flight (inside a catch).
void SetErrorFromCurrentException() {
  try {
    throw;
  } catch (const NetOpFailed& e) {
    PyErr_SetString(g_op_failure_type, e.what());
  } catch (const InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// Reads `n` integer arguments; false (with a TypeError set) on a count or type mismatch.
bool ReadInts(const char* fn, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t n, long long* out) {
  if (nargs != n) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd integer arguments, got %zd", fn, n, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

InterNodeHandle* HandleAt(long long address) {
  if (address == 0) {
    PyErr_SetString(PyExc_RuntimeError, "the EP operator is closed");
    return nullptr;
  }
  return reinterpret_cast<InterNodeHandle*>(static_cast<uintptr_t>(address));
}

// launch_dispatch(handle, input, row_bytes, num_tokens, weights, scales, indices, blocks, warps,
//                 rdma_blocks, finish, stream)
PyObject* LaunchDispatch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[12];
  if (!ReadInts("launch_dispatch", args, nargs, 12, v)) return nullptr;
  InterNodeHandle* h = HandleAt(v[0]);
  if (!h) return nullptr;
  try {
    h->Dispatch(v[1], static_cast<int>(v[2]), static_cast<int>(v[3]), v[4], v[5], v[6], static_cast<int>(v[7]),
                static_cast<int>(v[8]), static_cast<int>(v[9]), v[10] != 0, v[11]);
  } catch (...) {
    SetErrorFromCurrentException();
    return nullptr;
  }
  Py_RETURN_NONE;
}

// launch_combine(handle, input, dtype, hidden, input_rows, weights, weight_rows, indices, num_tokens,
//                push, blocks, warps, finish, stream)
PyObject* LaunchCombine(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[14];
  if (!ReadInts("launch_combine", args, nargs, 14, v)) return nullptr;
  InterNodeHandle* h = HandleAt(v[0]);
  if (!h) return nullptr;
  try {
    h->Combine(v[1], static_cast<int>(v[2]), static_cast<int>(v[3]), static_cast<int>(v[4]), v[5],
               static_cast<int>(v[6]), v[7], static_cast<int>(v[8]), v[9] != 0, static_cast<int>(v[10]),
               static_cast<int>(v[11]), v[12] != 0, v[13]);
  } catch (...) {
    SetErrorFromCurrentException();
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kLaunchDispatchDef = {
    "launch_dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&LaunchDispatch)), METH_FASTCALL,
    "launch_dispatch(handle_address, input, row_bytes, num_tokens, weights, scales, indices, block_num, "
    "warp_per_block, rdma_block_num, finish, stream): launch a dispatch's send half, and its receive half when "
    "finish (ints only; the inter-node op's hot path)."};
PyMethodDef kLaunchCombineDef = {
    "launch_combine", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&LaunchCombine)), METH_FASTCALL,
    "launch_combine(handle_address, input, dtype, hidden_dim, input_rows, weights, weight_rows, indices, "
    "num_tokens, push, block_num, warp_per_block, finish, stream): launch a combine's send half, and its receive "
    "half when finish."};

}  // namespace

void RegisterFastCalls(pybind11::module_& m, PyObject* op_failure_type) {
  g_op_failure_type = op_failure_type;
  for (PyMethodDef* def : {&kLaunchDispatchDef, &kLaunchCombineDef}) {
    pybind11::object fn = pybind11::reinterpret_steal<pybind11::object>(PyCFunction_NewEx(def, nullptr, nullptr));
    if (!fn) throw pybind11::error_already_set();
    m.add_object(def->ml_name, fn);
  }
}

}  // namespace mori::ep::inter
