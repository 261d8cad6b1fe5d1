// Control-plane authentication primitives.
//
// HMAC-SHA256 comes from the system's OpenSSL libcrypto, opened with dlopen
// only when a shared secret is configured: the core installs and runs without
// it, and engines that use a secret fail with a clear message if it is absent.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace mori::io::net {

using Digest = std::array<uint8_t, 32>;
using Nonce = std::array<uint8_t, 32>;
// Frame tags are HMAC-SHA256 truncated to 128 bits (RFC 2104 section 5, RFC 4868).
using Tag = std::array<uint8_t, 16>;

// Throws mori::BadState when libcrypto cannot be loaded.
Digest HmacSha256(const std::string& key, const std::string& message);
Nonce RandomNonce();
bool ConstantTimeEqual(const Digest& a, const Digest& b);
bool ConstantTimeEqual(const Tag& a, const Tag& b);

// One byte range of a message to authenticate.
struct Bytes {
  const void* data;
  size_t size;
};

// Authenticates the frames of one direction of one connection with a key
// derived in the handshake. A keyed libcrypto HMAC context is set up once and
// reused per frame (HMAC_Init_ex with a null key keeps the key schedule), so
// a tag costs two SHA-256 compressions plus the frame's bytes. Each party
// includes a counter it keeps in step with its peer (the request id, or the
// frame's position on the stream), so a frame cannot be replayed, reordered
// or dropped unnoticed. A default-constructed (unkeyed) FrameMac is off: Sign
// gives zeros and Verify accepts anything, as when no secret is set.
// Not thread-safe: one sending (or one receiving) thread at a time.
class FrameMac {
 public:
  FrameMac() = default;
  explicit FrameMac(const Digest& key);
  ~FrameMac();
  FrameMac(FrameMac&& o) noexcept : ctx_(o.ctx_) { o.ctx_ = nullptr; }
  FrameMac& operator=(FrameMac&& o) noexcept;
  FrameMac(const FrameMac&) = delete;
  FrameMac& operator=(const FrameMac&) = delete;

  bool enabled() const { return ctx_ != nullptr; }
  Tag Sign(uint64_t counter, std::initializer_list<Bytes> parts);
  bool Verify(uint64_t counter, std::initializer_list<Bytes> parts, const Tag& tag);

 private:
  void* ctx_ = nullptr;  // HMAC_CTX*
};

// The keys of one authenticated connection (all zero and unused without a secret).
struct SessionKeys {
  bool enabled = false;
  Digest clientToServer{};
  Digest serverToClient{};
  // This side's sending / receiving FrameMacs.
  FrameMac ForSending(bool isClient) const;
  FrameMac ForReceiving(bool isClient) const;
};

}  // namespace mori::io::net
