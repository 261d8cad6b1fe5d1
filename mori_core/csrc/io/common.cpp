#include "io/common.hpp"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "common/byte_codec.hpp"
#include "common/env.hpp"

namespace mori::io {

// ------------------------------------------------------------------- strings
const char* ToString(BackendType t) {
  switch (t) {
    case BackendType::XGMI: return "XGMI";
    case BackendType::RDMA: return "RDMA";
    case BackendType::TCP: return "TCP";
    case BackendType::FABRIC: return "FABRIC";
    default: return "Unknown";
  }
}

const char* ToString(MemoryLocationType t) {
  switch (t) {
    case MemoryLocationType::CPU: return "CPU";
    case MemoryLocationType::GPU: return "GPU";
    default: return "Unknown";
  }
}

const char* ToString(StatusCode c) {
  switch (c) {
    case StatusCode::SUCCESS: return "SUCCESS";
    case StatusCode::INIT: return "INIT";
    case StatusCode::IN_PROGRESS: return "IN_PROGRESS";
    case StatusCode::ERR_INVALID_ARGS: return "ERR_INVALID_ARGS";
    case StatusCode::ERR_NOT_FOUND: return "ERR_NOT_FOUND";
    case StatusCode::ERR_RDMA_OP: return "ERR_RDMA_OP";
    case StatusCode::ERR_BAD_STATE: return "ERR_BAD_STATE";
    case StatusCode::ERR_GPU_OP: return "ERR_GPU_OP";
    default: return "ERR_UNKNOWN";
  }
}

// --------------------------------------------------------------- descriptors
namespace {
constexpr uint32_t kEngineDescMagic = 0x4d454431;  // "MED1"
constexpr uint32_t kMemoryDescMagic = 0x4d4d4431;  // "MMD1"

void CheckMagic(uint32_t got, uint32_t want, const char* what) {
  if (got != want)
    throw InvalidArgument(std::string(what) + ": not a packed descriptor of this version");
}
}  // namespace

std::vector<uint8_t> EngineDesc::Pack() const {
  ByteWriter w;
  w.Put<uint32_t>(kEngineDescMagic);
  w.PutString(key);
  w.PutString(nodeId);
  w.PutString(hostname);
  w.PutString(host);
  w.Put<uint16_t>(port);
  w.Put<int32_t>(pid);
  return w.Take();
}

EngineDesc EngineDesc::Unpack(const void* data, size_t size) {
  ByteReader r(data, size, "EngineDesc.unpack");
  CheckMagic(r.Get<uint32_t>(), kEngineDescMagic, "EngineDesc.unpack");
  EngineDesc d;
  d.key = r.GetString(kMaxKeyBytes);
  d.nodeId = r.GetString(kMaxKeyBytes);
  d.hostname = r.GetString(kMaxKeyBytes);
  d.host = r.GetString(kMaxKeyBytes);
  d.port = r.Get<uint16_t>();
  d.pid = r.Get<int32_t>();
  if (r.remaining() != 0) throw InvalidArgument("EngineDesc.unpack: trailing bytes");
  return d;
}

bool MemoryDesc::HasIpcHandle() const {
  for (uint8_t b : ipcHandle)
    if (b) return true;
  return false;
}

std::vector<uint8_t> MemoryDesc::Pack() const {
  ByteWriter w;
  w.Put<uint32_t>(kMemoryDescMagic);
  w.PutString(engineKey);
  w.Put<uint32_t>(id);
  w.Put<int32_t>(deviceId);
  w.PutString(deviceBusId);
  w.Put<uint64_t>(data);
  w.Put<uint64_t>(size);
  w.Put<uint32_t>(static_cast<uint32_t>(loc));
  w.PutBytes(ipcHandle.data(), ipcHandle.size());
  w.Put<uint64_t>(ipcOffset);
  w.Put<int32_t>(numaNode);
  return w.Take();
}

MemoryDesc MemoryDesc::Unpack(const void* data, size_t size) {
  ByteReader r(data, size, "MemoryDesc.unpack");
  CheckMagic(r.Get<uint32_t>(), kMemoryDescMagic, "MemoryDesc.unpack");
  MemoryDesc d;
  d.engineKey = r.GetString(kMaxKeyBytes);
  d.id = r.Get<uint32_t>();
  d.deviceId = r.Get<int32_t>();
  d.deviceBusId = r.GetString(kMaxKeyBytes);
  d.data = r.Get<uint64_t>();
  d.size = r.Get<uint64_t>();
  uint32_t loc = r.Get<uint32_t>();
  if (loc > static_cast<uint32_t>(MemoryLocationType::GPU))
    throw InvalidArgument("MemoryDesc.unpack: unknown memory location " + std::to_string(loc));
  d.loc = static_cast<MemoryLocationType>(loc);
  r.GetBytes(d.ipcHandle.data(), d.ipcHandle.size());
  d.ipcOffset = r.Get<uint64_t>();
  d.numaNode = r.Get<int32_t>();
  if (r.remaining() != 0) throw InvalidArgument("MemoryDesc.unpack: trailing bytes");
  return d;
}

// ------------------------------------------------------------ TransferStatus
StatusCode TransferStatus::Code() {
  Progress();
  return static_cast<StatusCode>(code_.load(std::memory_order_acquire));
}

std::string TransferStatus::Message() const {
  std::lock_guard<std::mutex> lock(mu_);
  return message_;
}

void TransferStatus::Update(StatusCode code, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto cur = static_cast<StatusCode>(code_.load(std::memory_order_relaxed));
    if (IsTerminal(cur)) return;
    if (!message.empty()) message_ = message;
    code_.store(static_cast<uint32_t>(code), std::memory_order_release);
  }
  if (IsTerminal(code)) cv_.notify_all();
}

void TransferStatus::SetCode(StatusCode code) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    code_.store(static_cast<uint32_t>(code), std::memory_order_release);
  }
  cv_.notify_all();
}

void TransferStatus::SetMessage(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  message_ = message;
}

void TransferStatus::SetProgressHook(std::function<void(TransferStatus&)> hook) {
  auto h = hook ? std::make_shared<const std::function<void(TransferStatus&)>>(std::move(hook)) : nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  progressHook_ = std::move(h);
}

void TransferStatus::Progress() {
  if (IsTerminal(static_cast<StatusCode>(code_.load(std::memory_order_acquire)))) return;
  std::shared_ptr<const std::function<void(TransferStatus&)>> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hook = progressHook_;
  }
  if (hook) (*hook)(*this);
}

void TransferStatus::Wait() { WaitFor(-1); }

StatusCode TransferStatus::WaitFor(int64_t timeoutMs) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = timeoutMs < 0 ? Clock::time_point::max()
                                      : Clock::now() + std::chrono::milliseconds(timeoutMs);
  bool hasHook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hasHook = static_cast<bool>(progressHook_);
  }
  if (hasHook) {
    // Lazily-completing backend (GPU events): poll its hook. Spin for the
    // first few hundred microseconds — copies of up to ~100 MB finish in that
    // time and a coarse sleep would dominate their latency — then poll every
    // 20 us, sleeping on the condition variable (a completion thread may also
    // wake us).
    const auto spinUntil = Clock::now() + std::chrono::microseconds(300);
    auto sleep = std::chrono::microseconds(5);
    while (true) {
      StatusCode c = Code();
      if (IsTerminal(c) || timeoutMs == 0 || Clock::now() >= deadline) return c;
      if (Clock::now() < spinUntil) continue;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, sleep, [&] { return IsTerminal(static_cast<StatusCode>(code_.load())); });
      }
      sleep = std::min(sleep * 2, std::chrono::microseconds(20));
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  auto done = [&] { return IsTerminal(static_cast<StatusCode>(code_.load(std::memory_order_acquire))); };
  if (timeoutMs < 0) {
    cv_.wait(lock, done);
  } else if (timeoutMs > 0) {
    cv_.wait_until(lock, deadline, done);
  }
  return static_cast<StatusCode>(code_.load(std::memory_order_acquire));
}

StatusCode WaitAll(const std::vector<StatusPtr>& statuses, int64_t timeoutMs) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  StatusCode firstError = StatusCode::SUCCESS;
  bool pending = false;
  for (const auto& s : statuses) {
    if (!s) continue;
    int64_t left = -1;
    if (timeoutMs >= 0) {
      auto used = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
      left = std::max<int64_t>(0, timeoutMs - used);
    }
    StatusCode c = s->WaitFor(left);
    if (IsError(c)) {
      if (firstError == StatusCode::SUCCESS) firstError = c;
    } else if (c != StatusCode::SUCCESS) {
      pending = true;
    }
  }
  if (firstError != StatusCode::SUCCESS) return firstError;
  return pending ? StatusCode::IN_PROGRESS : StatusCode::SUCCESS;
}

// -------------------------------------------------------------- node identity
std::string LocalHostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string LocalNodeId() {
  if (auto v = env::GetString("MORI_NODE_ID")) return *v;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return id;
  return LocalHostname();
}

}  // namespace mori::io
