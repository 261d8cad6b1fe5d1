// Control-plane authentication primitives.
//
// HMAC-SHA256 comes from the system's OpenSSL libcrypto, opened with dlopen
// only when a shared secret is configured: the core installs and runs without
// it, and engines that use a secret fail with a clear message if it is absent.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace mori::io::net {

using Digest = std::array<uint8_t, 32>;
using Nonce = std::array<uint8_t, 32>;

// Throws mori::BadState when libcrypto cannot be loaded.
Digest HmacSha256(const std::string& key, const std::string& message);
Nonce RandomNonce();
bool ConstantTimeEqual(const Digest& a, const Digest& b);

}  // namespace mori::io::net
