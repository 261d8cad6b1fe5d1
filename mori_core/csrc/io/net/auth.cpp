#include "io/net/auth.hpp"

#include <dlfcn.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "common/error.hpp"

namespace mori::io::net {
namespace {

// Prototypes of the libcrypto functions we use (all exported by OpenSSL 1.1 and 3.x).
using EvpSha256Fn = const void* (*)();
using HmacFn = unsigned char* (*)(const void* md, const void* key, int keyLen, const unsigned char* d,
                                  size_t n, unsigned char* out, unsigned int* outLen);
using CtxNewFn = void* (*)();
using CtxFreeFn = void (*)(void*);
using InitFn = int (*)(void* ctx, const void* key, int keyLen, const void* md, void* engine);
using UpdateFn = int (*)(void* ctx, const unsigned char* data, size_t n);
using FinalFn = int (*)(void* ctx, unsigned char* out, unsigned int* outLen);

struct Crypto {
  EvpSha256Fn sha256 = nullptr;
  HmacFn hmac = nullptr;
  CtxNewFn ctxNew = nullptr;
  CtxFreeFn ctxFree = nullptr;
  InitFn init = nullptr;
  UpdateFn update = nullptr;
  FinalFn final = nullptr;
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
      c.ctxNew = reinterpret_cast<CtxNewFn>(::dlsym(h, "HMAC_CTX_new"));
      c.ctxFree = reinterpret_cast<CtxFreeFn>(::dlsym(h, "HMAC_CTX_free"));
      c.init = reinterpret_cast<InitFn>(::dlsym(h, "HMAC_Init_ex"));
      c.update = reinterpret_cast<UpdateFn>(::dlsym(h, "HMAC_Update"));
      c.final = reinterpret_cast<FinalFn>(::dlsym(h, "HMAC_Final"));
      if (c.sha256 && c.hmac && c.ctxNew && c.ctxFree && c.init && c.update && c.final) return;
    }
    c.sha256 = nullptr;
    c.hmac = nullptr;
    c.error = "an auth secret is set but OpenSSL's libcrypto (libcrypto.so.3 / .so.1.1) could not be loaded";
  });
  return c;
}

const Crypto& NeedCrypto() {
  const Crypto& c = LoadCrypto();
  if (!c.hmac) throw BadState(c.error);
  return c;
}

}  // namespace

Digest HmacSha256(const std::string& key, const std::string& message) {
  const Crypto& c = NeedCrypto();
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

namespace {
template <size_t N>
bool CtEqual(const std::array<uint8_t, N>& a, const std::array<uint8_t, N>& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < N; ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}
}  // namespace

bool ConstantTimeEqual(const Digest& a, const Digest& b) { return CtEqual(a, b); }
bool ConstantTimeEqual(const Tag& a, const Tag& b) { return CtEqual(a, b); }

// ------------------------------------------------------------------ FrameMac
FrameMac::FrameMac(const Digest& key) {
  const Crypto& c = NeedCrypto();
  ctx_ = c.ctxNew();
  if (!ctx_ || !c.init(ctx_, key.data(), static_cast<int>(key.size()), c.sha256(), nullptr)) {
    if (ctx_) c.ctxFree(ctx_);
    ctx_ = nullptr;
    throw BadState("HMAC_Init_ex failed in libcrypto");
  }
}

FrameMac::~FrameMac() {
  if (ctx_) LoadCrypto().ctxFree(ctx_);
}

FrameMac& FrameMac::operator=(FrameMac&& o) noexcept {
  if (this != &o) {
    if (ctx_) LoadCrypto().ctxFree(ctx_);
    ctx_ = o.ctx_;
    o.ctx_ = nullptr;
  }
  return *this;
}

Tag FrameMac::Sign(uint64_t counter, std::initializer_list<Bytes> parts) {
  Tag tag{};
  if (!ctx_) return tag;
  const Crypto& c = LoadCrypto();
  Digest full{};
  unsigned int len = 0;
  // A null key and md re-use the key schedule set up in the constructor.
  bool ok = c.init(ctx_, nullptr, 0, nullptr, nullptr) &&
            c.update(ctx_, reinterpret_cast<const unsigned char*>(&counter), sizeof(counter));
  for (const Bytes& p : parts) ok = ok && c.update(ctx_, static_cast<const unsigned char*>(p.data), p.size);
  ok = ok && c.final(ctx_, full.data(), &len) && len == full.size();
  if (!ok) throw BadState("HMAC-SHA256 failed in libcrypto");
  std::memcpy(tag.data(), full.data(), tag.size());
  return tag;
}

bool FrameMac::Verify(uint64_t counter, std::initializer_list<Bytes> parts, const Tag& tag) {
  if (!ctx_) return true;
  return ConstantTimeEqual(Sign(counter, parts), tag);
}

FrameMac SessionKeys::ForSending(bool isClient) const {
  if (!enabled) return FrameMac();
  return FrameMac(isClient ? clientToServer : serverToClient);
}

FrameMac SessionKeys::ForReceiving(bool isClient) const {
  if (!enabled) return FrameMac();
  return FrameMac(isClient ? serverToClient : clientToServer);
}

}  // namespace mori::io::net
