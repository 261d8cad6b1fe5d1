// Exception types of the core. The bindings map them to Python exceptions:
// InvalidArgument -> ValueError, NotFound -> KeyError, the rest -> RuntimeError.
#pragma once

#include <stdexcept>
#include <string>

namespace mori {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

class NotFound : public Error {
 public:
  using Error::Error;
};

class BadState : public Error {
 public:
  using Error::Error;
};

class GpuError : public Error {
 public:
  using Error::Error;
};

}  // namespace mori
