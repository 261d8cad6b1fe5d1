// Reading MORI's offset and size arguments without a Python object per element.
//
// A batch of 64 pages used to cost 192 pybind11 integer conversions before any
// C++ ran. These readers take a list or tuple of ints (one C-API call per item),
// a 1-D numpy array or any C-contiguous buffer of integers (copied in one
// pass), or any other iterable of ints, and name the offending argument and
// index on bad input.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace mori::bindings {

// Reads `obj` into *out (replacing its contents). Raises TypeError naming
// `name[i]` for a negative, bool, non-integer or too large (>= 2**64) item, and
// naming `name` for a buffer that is not a contiguous 1-D array of integers.
void ReadOffsets(pybind11::handle obj, const char* name, std::vector<uint64_t>* out);

// Same, with the argument named "<name>[<index>]" (items of engine-level batches).
void ReadOffsets(pybind11::handle obj, const char* name, size_t index, std::vector<uint64_t>* out);

}  // namespace mori::bindings
