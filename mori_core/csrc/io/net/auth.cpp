#include "io/net/auth.hpp"

#include <dlfcn.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "common/error.hpp"

namespace mori::io::net {
namespace {

// Prototypes of the two libcrypto functions we use (stable since OpenSSL 1.0).
using EvpSha256Fn = const void* (*)();
using HmacFn = unsigned char* (*)(const void* md, const void* key, int keyLen, const unsigned char* d,
                                  size_t n, unsigned char* out, unsigned int* outLen);

struct Crypto {
  EvpSha256Fn sha256 = nullptr;
  HmacFn hmac = nullptr;
  std::string error;
};

const Crypto& LoadCrypto() {
  static Crypto c;
  static std::once_flag once;
  std::call_once(once, [] {
    for (const char* name : {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"}) {
      void* h = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (!h) continue;
      c.sha256 = reinterpret_cast<EvpSha256Fn>(::dlsym(h, "EVP_sha256"));
      c.hmac = reinterpret_cast<HmacFn>(::dlsym(h, "HMAC"));
      if (c.sha256 && c.hmac) return;
    }
    c.error = "an auth secret is set but OpenSSL's libcrypto (libcrypto.so.3 / .so.1.1) could not be loaded";
  });
  return c;
}

}  // namespace

Digest HmacSha256(const std::string& key, const std::string& message) {
  const Crypto& c = LoadCrypto();
  if (!c.hmac) throw BadState(c.error);
  Digest out{};
  unsigned int len = 0;
  if (!c.hmac(c.sha256(), key.data(), static_cast<int>(key.size()),
              reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(), &len) ||
      len != out.size())
    throw BadState("HMAC-SHA256 failed in libcrypto");
  return out;
}

Nonce RandomNonce() {
  Nonce n{};
  size_t got = 0;
  while (got < n.size()) {
    ssize_t r = ::getrandom(n.data() + got, n.size() - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw BadState(std::string("getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
  return n;
}

bool ConstantTimeEqual(const Digest& a, const Digest& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

}  // namespace mori::io::net
