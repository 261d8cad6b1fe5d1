// Moves data between GPU memory and a socket through pinned host buffers.
//
// Two buffers alternate so the device copy of one piece overlaps the socket
// transfer of the other. Ranges may be many small scattered pieces: they are
// packed back to back into a buffer. One stager belongs to one thread.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/net/socket.hpp"

namespace mori::io::tcp {

using ByteRange = std::pair<uint64_t, uint64_t>;  // (offset from base, size)

class DeviceStager {
 public:
  explicit DeviceStager(uint64_t bytes);
  ~DeviceStager();
  DeviceStager(const DeviceStager&) = delete;
  DeviceStager& operator=(const DeviceStager&) = delete;

  bool SendFromDevice(net::Socket& sock, int device, const uint8_t* base, const std::vector<ByteRange>& ranges,
                      int64_t timeoutMs, std::string* err);
  bool RecvToDevice(net::Socket& sock, int device, uint8_t* base, const std::vector<ByteRange>& ranges,
                    int64_t timeoutMs, std::string* err);

 private:
  bool Ensure(int device, std::string* err);
  void Release();
  uint64_t half_;
  int device_ = -1;
  uint8_t* buf_[2] = {nullptr, nullptr};
  void* stream_ = nullptr;
  void* events_[2] = {nullptr, nullptr};
};

}  // namespace mori::io::tcp
