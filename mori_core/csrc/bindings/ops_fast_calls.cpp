// Hot-path entry points of the EP handle: dispatch and combine launches as
// plain CPython METH_FASTCALL functions taking ints.
//
// Why not pybind11 like the rest: an eager dispatch/combine call is a few
// microseconds of host time end to end, and pybind11's generic argument
// loader costs a sizeable share of it for 10-14 arguments. These functions
// read the ints straight from the argument vector and translate the core's
// exceptions exactly as the module's pybind11 translators do.
//
// The first argument is the handle's address (EpDispatchCombineHandle.address);
// the Python op keeps the handle alive and passes 0 after close(), which is
// refused here.
#include <Python.h>

#include <cstdint>
#include <exception>

#include "bindings/bindings.hpp"
#include "common/error.hpp"
#include "ops/ep_handle.hpp"

namespace py = pybind11;

namespace mori::bindings {
namespace {

PyObject* g_op_failure_type = nullptr;  // mori_core._C.EpOpFailure

// Sets the Python error for the C++ exception in flight (inside a catch).
void SetErrorFromCurrentException() {
  try {
    throw;
  } catch (const ep::OpFailed& e) {
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

ep::EpHandle* HandleAt(long long address) {
  if (address == 0) {
    PyErr_SetString(PyExc_RuntimeError, "the EP operator is closed");
    return nullptr;
  }
  return reinterpret_cast<ep::EpHandle*>(static_cast<uintptr_t>(address));
}

// ep_launch_dispatch(handle, input, row_bytes, num_tokens, weights, scales, indices, blocks, warps, stream)
PyObject* LaunchDispatch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[10];
  if (!ReadInts("ep_launch_dispatch", args, nargs, 10, v)) return nullptr;
  ep::EpHandle* h = HandleAt(v[0]);
  if (!h) return nullptr;
  try {
    h->Dispatch(v[1], static_cast<int>(v[2]), static_cast<int>(v[3]), v[4], v[5], v[6], static_cast<int>(v[7]),
                static_cast<int>(v[8]), v[9]);
  } catch (...) {
    SetErrorFromCurrentException();
    return nullptr;
  }
  Py_RETURN_NONE;
}

// ep_launch_combine(handle, input, dtype, hidden, input_rows, weights, weight_rows,
//                   indices, num_tokens, mode (0 pull, 1 push, 2 copy-pull), blocks, warps, stream)
PyObject* LaunchCombine(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[13];
  if (!ReadInts("ep_launch_combine", args, nargs, 13, v)) return nullptr;
  ep::EpHandle* h = HandleAt(v[0]);
  if (!h) return nullptr;
  try {
    h->Combine(v[1], static_cast<int>(v[2]), static_cast<int>(v[3]), static_cast<int>(v[4]), v[5],
               static_cast<int>(v[6]), v[7], static_cast<int>(v[8]), static_cast<int>(v[9]), static_cast<int>(v[10]),
               static_cast<int>(v[11]), v[12]);
  } catch (...) {
    SetErrorFromCurrentException();
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kLaunchDispatchDef = {
    "ep_launch_dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&LaunchDispatch)), METH_FASTCALL,
    "ep_launch_dispatch(handle_address, input, row_bytes, num_tokens, weights, scales, indices, block_num, "
    "warp_per_block, stream): launch one dispatch (ints only; the EP op's hot path)."};
PyMethodDef kLaunchCombineDef = {
    "ep_launch_combine", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&LaunchCombine)), METH_FASTCALL,
    "ep_launch_combine(handle_address, input, dtype, hidden_dim, input_rows, weights, weight_rows, "
    "indices, num_tokens, mode, block_num, warp_per_block, stream): launch one combine (mode 0 pull, 1 push, "
    "2 copy into the registered buffer, then pull)."};

}  // namespace

void RegisterOpsFastCalls(py::module_& m, PyObject* op_failure_type) {
  g_op_failure_type = op_failure_type;
  for (PyMethodDef* def : {&kLaunchDispatchDef, &kLaunchCombineDef}) {
    py::object fn = py::reinterpret_steal<py::object>(PyCFunction_NewEx(def, nullptr, nullptr));
    if (!fn) throw py::error_already_set();
    m.add_object(def->ml_name, fn);
  }
}

}  // namespace mori::bindings
