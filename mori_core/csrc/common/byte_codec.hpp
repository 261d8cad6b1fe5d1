// Bounded little-endian byte codec for descriptors and wire messages.
// Every Get* checks the remaining length and throws InvalidArgument instead of
// reading past the end, so truncated or hostile input is rejected cleanly.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common/error.hpp"

namespace mori {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire codec assumes a little-endian host");

class ByteWriter {
 public:
  template <typename T>
  void Put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  void PutBytes(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + n);
  }
  // Length-prefixed (u32) string.
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    PutBytes(s.data(), s.size());
  }
  const std::vector<uint8_t>& bytes() const { return buf_; }
  std::vector<uint8_t> Take() { return std::move(buf_); }

 private:
  std::vector<uint8_t> buf_;
};

class ByteReader {
 public:
  ByteReader(const void* data, size_t size, const char* what)
      : p_(static_cast<const uint8_t*>(data)), left_(size), what_(what) {}

  template <typename T>
  T Get() {
    static_assert(std::is_trivially_copyable_v<T>);
    Need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    Advance(sizeof(T));
    return v;
  }
  void GetBytes(void* out, size_t n) {
    Need(n);
    std::memcpy(out, p_, n);
    Advance(n);
  }
  std::string GetString(size_t max_len) {
    uint32_t n = Get<uint32_t>();
    if (n > max_len)
      throw InvalidArgument(std::string(what_) + ": string field of " + std::to_string(n) +
                            " bytes exceeds the limit of " + std::to_string(max_len));
    Need(n);
    std::string s(reinterpret_cast<const char*>(p_), n);
    Advance(n);
    return s;
  }
  size_t remaining() const { return left_; }

 private:
  void Need(size_t n) const {
    if (n > left_) throw InvalidArgument(std::string(what_) + ": truncated input");
  }
  void Advance(size_t n) {
    p_ += n;
    left_ -= n;
  }
  const uint8_t* p_;
  size_t left_;
  const char* what_;
};

}  // namespace mori
