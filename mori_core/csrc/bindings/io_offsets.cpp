#include "bindings/io_offsets.hpp"

#include <cstring>
#include <string>
#include <type_traits>

namespace py = pybind11;

namespace mori::bindings {
namespace {

// An argument's name for error messages, built only when one is raised ("sizes", or
// "local_offsets[3]" for an item of an engine-level batch): a batch of 66 region pairs
// used to format 198 such strings per call that no one read.
struct Arg {
  const char* name;
  long index;  // -1: the argument itself
  std::string str() const { return index < 0 ? name : std::string(name) + "[" + std::to_string(index) + "]"; }
};

[[noreturn]] void Raise(const std::string& msg) {
  PyErr_SetString(PyExc_TypeError, msg.c_str());
  throw py::error_already_set();
}

std::string Repr(PyObject* o) {
  PyObject* r = PyObject_Repr(o);
  if (!r) {
    PyErr_Clear();
    return "?";
  }
  const char* s = PyUnicode_AsUTF8(r);
  std::string out = s ? s : "?";
  Py_DECREF(r);
  if (out.size() > 80) out = out.substr(0, 77) + "...";
  return out;
}

[[noreturn]] void BadValue(const Arg& name, size_t i, const std::string& repr) {
  Raise(name.str() + "[" + std::to_string(i) + "] must be a non-negative int below 2**64, got " + repr);
}

[[noreturn]] void BadItem(const Arg& name, size_t i, PyObject* item) { BadValue(name, i, Repr(item)); }

// One Python int (or an object with __index__, e.g. numpy.int64) -> uint64.
uint64_t ItemValue(PyObject* item, const Arg& name, size_t i) {
  if (PyLong_CheckExact(item)) {
#if PY_VERSION_HEX >= 0x030C0000
    // Ints below 2**30 are "compact" since Python 3.12: read them inline.
    const auto* l = reinterpret_cast<const PyLongObject*>(item);
    if (PyUnstable_Long_IsCompact(l)) {
      const Py_ssize_t v = PyUnstable_Long_CompactValue(l);
      if (v >= 0) return static_cast<uint64_t>(v);
      BadItem(name, i, item);
    }
#endif
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow == 0 && v >= 0) return static_cast<uint64_t>(v);
    if (overflow == 0 && v == -1 && PyErr_Occurred()) PyErr_Clear();
    if (overflow > 0) {
      unsigned long long u = PyLong_AsUnsignedLongLong(item);
      if (!(u == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return u;
      PyErr_Clear();
    }
    BadItem(name, i, item);
  }
  if (PyBool_Check(item) || PyFloat_Check(item)) BadItem(name, i, item);
  PyObject* idx = PyNumber_Index(item);
  if (!idx) {
    PyErr_Clear();
    BadItem(name, i, item);
  }
  uint64_t v = 0;
  try {
    v = ItemValue(idx, name, i);
  } catch (...) {
    Py_DECREF(idx);
    throw;
  }
  Py_DECREF(idx);
  return v;
}

// Reads a buffer of integers; false when `obj` exposes no buffer.
bool ReadBuffer(PyObject* obj, const Arg& name, std::vector<uint64_t>* out) {
  if (!PyObject_CheckBuffer(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj)) return false;
  Py_buffer view;
  if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
    PyErr_Clear();
    Raise(name.str() + " must be a list of ints or a contiguous 1-D integer array (this buffer is not contiguous)");
  }
  struct Release {
    Py_buffer* v;
    ~Release() { PyBuffer_Release(v); }
  } release{&view};
  if (view.ndim != 1)
    Raise(name.str() + " must be 1-D, got an array with " + std::to_string(view.ndim) + " dimensions");
  const char* fmt = view.format ? view.format : "B";
  if (*fmt == '@' || *fmt == '=') ++fmt;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  if (*fmt == '<') ++fmt;
#else
  if (*fmt == '>' || *fmt == '!') ++fmt;
#endif
  const char code = fmt[0];
  const bool known = fmt[0] != '\0' && fmt[1] == '\0' && std::strchr("bBhHiIlLqQnN", code) != nullptr;
  if (!known)
    Raise(name.str() + " must hold integers, got an array of format '" + std::string(view.format ? view.format : "") +
          "'");
  const bool isSigned = std::strchr("bhilqn", code) != nullptr;
  const size_t n = static_cast<size_t>(view.len / view.itemsize);
  out->resize(n);
  uint64_t* dst = out->data();
  auto copy = [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(view.buf);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_signed_v<T>) {
        if (src[i] < 0) BadValue(name, i, std::to_string(src[i]));
      }
      dst[i] = static_cast<uint64_t>(src[i]);
    }
  };
  switch (view.itemsize) {
    case 1: isSigned ? copy(int8_t{}) : copy(uint8_t{}); break;
    case 2: isSigned ? copy(int16_t{}) : copy(uint16_t{}); break;
    case 4: isSigned ? copy(int32_t{}) : copy(uint32_t{}); break;
    case 8:
      if (isSigned) {
        // numpy's int64 (what planners hand over): one OR over the sign bits, which the
        // compiler vectorises, then a plain copy; the element loop only to name a bad value.
        const auto* src = static_cast<const uint64_t*>(view.buf);
        uint64_t signs = 0;
        for (size_t i = 0; i < n; ++i) signs |= src[i];
        if (signs >> 63) copy(int64_t{});
        else std::memcpy(dst, src, n * sizeof(uint64_t));
      } else {
        std::memcpy(dst, view.buf, n * sizeof(uint64_t));
      }
      break;
    default: Raise(name.str() + " must hold integers of 1, 2, 4 or 8 bytes, got " + std::to_string(view.itemsize));
  }
  return true;
}

void Read(py::handle h, const Arg& name, std::vector<uint64_t>* out) {
  PyObject* obj = h.ptr();
  if (!PyList_Check(obj) && !PyTuple_Check(obj) && ReadBuffer(obj, name, out)) return;
  if (PyUnicode_Check(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj))
    Raise(name.str() + " must be a list of ints or a 1-D integer array, got " + Py_TYPE(obj)->tp_name);
  PyObject* seq = PySequence_Fast(obj, "");
  if (!seq) {
    PyErr_Clear();
    Raise(name.str() + " must be a list of ints or a 1-D integer array, got " + Py_TYPE(obj)->tp_name);
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out->resize(static_cast<size_t>(n));
  try {
    for (Py_ssize_t i = 0; i < n; ++i) (*out)[i] = ItemValue(items[i], name, static_cast<size_t>(i));
  } catch (...) {
    Py_DECREF(seq);
    throw;
  }
  Py_DECREF(seq);
}

}  // namespace

void ReadOffsets(py::handle obj, const char* name, std::vector<uint64_t>* out) { Read(obj, Arg{name, -1}, out); }

void ReadOffsets(py::handle obj, const char* name, size_t index, std::vector<uint64_t>* out) {
  Read(obj, Arg{name, static_cast<long>(index)}, out);
}

}  // namespace mori::bindings
