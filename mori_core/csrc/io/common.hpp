// Descriptors, configurations and the TransferStatus contract of MORI-IO.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/enum.hpp"

namespace mori::io {

using MemoryUniqueId = uint32_t;
using TransferUniqueId = uint64_t;

constexpr size_t kIpcHandleBytes = 64;
constexpr size_t kMaxKeyBytes = 512;  // engine keys, host names, bus ids

// ---------------------------------------------------------------------------
// Descriptors. Both are plain values exchanged out of band between engines
// (pack() -> bytes -> unpack()); unpack validates lengths and a format version.
// ---------------------------------------------------------------------------
struct EngineDesc {
  std::string key;
  std::string nodeId;    // MORI_NODE_ID, else the kernel boot id, else hostname
  std::string hostname;
  std::string host;      // address peers connect to ("" when no listener)
  uint16_t port = 0;     // 0 when the engine has no network listener
  int32_t pid = 0;

  std::vector<uint8_t> Pack() const;
  static EngineDesc Unpack(const void* data, size_t size);
  bool operator==(const EngineDesc& o) const {
    return key == o.key && nodeId == o.nodeId && hostname == o.hostname && host == o.host &&
           port == o.port && pid == o.pid;
  }
};

struct MemoryDesc {
  std::string engineKey;
  MemoryUniqueId id = 0;
  int32_t deviceId = -1;
  std::string deviceBusId;  // lower-case PCI BDF for GPU memory
  uint64_t data = 0;        // address in the owner's process
  uint64_t size = 0;
  MemoryLocationType loc = MemoryLocationType::Unknown;
  std::array<uint8_t, kIpcHandleBytes> ipcHandle{};  // handle of the allocation base (XGMI)
  uint64_t ipcOffset = 0;                             // offset of `data` inside that allocation
  int32_t numaNode = -1;

  std::vector<uint8_t> Pack() const;
  static MemoryDesc Unpack(const void* data, size_t size);
  // Equality ignores the IPC handle, as MORI does.
  bool operator==(const MemoryDesc& o) const {
    return engineKey == o.engineKey && id == o.id && deviceId == o.deviceId &&
           deviceBusId == o.deviceBusId && data == o.data && size == o.size && loc == o.loc &&
           numaNode == o.numaNode;
  }
  bool HasIpcHandle() const;
};

// ---------------------------------------------------------------------------
// Configurations.
// ---------------------------------------------------------------------------
struct IOEngineConfig {
  std::string host;   // address to bind and advertise; "" = all interfaces, advertise a routable one
  uint16_t port = 0;  // 0 = ephemeral, read back from GetEngineDesc() after CreateBackend
  // Shared secret for the control plane (challenge-response HMAC-SHA256).
  // Empty = take MORI_IO_AUTH_SECRET; still empty = no authentication.
  std::string authSecret;
  // In GPU builds with a visible GPU, creating a network backend (TCP/RDMA)
  // also creates the XGMI backend, and same-node GPU pairs route to it.
  // False (or MORI_IO_DISABLE_AUTO_XGMI=1) keeps XGMI out of routing unless
  // it was created explicitly.
  bool enableAutoXgmi = true;
};

struct BackendConfig {
  virtual ~BackendConfig() = default;
};

struct TcpBackendConfig : BackendConfig {
  int numConnections = 4;              // sockets per remote engine
  uint64_t chunkBytes = 4ull << 20;    // largest frame payload; large transfers are split
  uint64_t minChunkBytes = 1ull << 20;  // below this a transfer is not split across sockets
  int64_t opTimeoutMs = 10000;         // no progress for this long on a busy socket -> fail
  int64_t connectTimeoutMs = 2000;
  uint64_t stagingBytes = 4ull << 20;  // pinned host staging per socket for GPU memory
  bool enableNotification = true;
  int sockBufBytes = 4 << 20;          // SO_SNDBUF / SO_RCVBUF
  // While transfers to a peer are outstanding, a separate connection pings it;
  // no answer for this long fails them (a stopped or hung peer). A live peer
  // answers even while a slow transfer drips, so slow links are not failed.
  // 0 = off (then only op_timeout_ms applies).
  int64_t heartbeatTimeoutMs = 1500;
};

struct RdmaBackendConfig : BackendConfig {
  int qpPerTransfer = 1;
  int postBatchSize = -1;
  int numWorkerThreads = -1;
  PollCqMode pollCqMode = PollCqMode::POLLING;
  bool enableNotification = true;
  int notifPerQp = 1024;
  bool enableTransferChunking = false;
  uint64_t chunkBytes = 65536;
  int maxChunksPerTransfer = 64;
  int numNicsPerTransfer = 1;
  int maxSendWr = 0;  // 0 = backend default
  int maxCqeNum = 0;
  int maxMsgSge = 0;
};

struct XgmiBackendConfig : BackendConfig {
  int numStreams = 64;
  int numEvents = 64;
  bool enableNotification = true;  // tell the target when a transfer landed (MORI's XGMI never does)
  // Persistent copy kernel for small GPU<->GPU transfers (io/p2p/copy_proxy.hpp):
  // 0 = off (default); else blocks it keeps resident on each initiating GPU.
  int proxyBlocks = 0;
  int64_t proxyMaxBytes = 1ll << 20;  // bigger transfers are launched as usual
  int64_t proxyIdleUs = 500;          // the resident grid leaves after this long idle
};

// ---------------------------------------------------------------------------
// TransferStatus: the completion record of one transfer.
//
// Contract (kept from MORI, made explicit):
//  * starts INIT, IN_PROGRESS once submitted, ends in SUCCESS or an ERR_* code;
//  * the first error wins: once an error is set nothing else changes the code;
//  * SUCCESS is final too (a backend reports it only after every part finished);
//  * Wait()/WaitFor() block without the GIL (the bindings release it) and
//    WaitFor(ms) returns IN_PROGRESS on timeout;
//  * backends that complete lazily (GPU events) install a progress hook that the
//    query methods call, so no thread has to spin for them.
// ---------------------------------------------------------------------------
class TransferStatus {
 public:
  TransferStatus() = default;
  TransferStatus(const TransferStatus&) = delete;
  TransferStatus& operator=(const TransferStatus&) = delete;

  StatusCode Code();
  std::string Message() const;
  bool Init() { return Code() == StatusCode::INIT; }
  bool InProgress() { return Code() == StatusCode::IN_PROGRESS; }
  bool Succeeded() { return Code() == StatusCode::SUCCESS; }
  bool Failed() { return IsError(Code()); }

  // Sets a new code unless the status is already terminal (first error wins).
  void Update(StatusCode code, const std::string& message = "");
  // Raw setters, for compatibility with MORI's API.
  void SetCode(StatusCode code);
  void SetMessage(const std::string& message);

  void Wait();
  StatusCode WaitFor(int64_t timeoutMs);

  // Installed by lazily-completing backends; called from Code()/Wait*.
  // Must be cheap and thread-safe; it calls Update() when it observes completion.
  void SetProgressHook(std::function<void(TransferStatus&)> hook);

 private:
  void Progress();

  std::atomic<uint32_t> code_{static_cast<uint32_t>(StatusCode::INIT)};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string message_;
  // Shared, so a poll copies a pointer (not the callable) out of the lock.
  std::shared_ptr<const std::function<void(TransferStatus&)>> progressHook_;
};

using StatusPtr = std::shared_ptr<TransferStatus>;

// Waits for all statuses; returns SUCCESS, the first error code seen, or
// IN_PROGRESS when the timeout (ms, < 0 = forever) expired first.
StatusCode WaitAll(const std::vector<StatusPtr>& statuses, int64_t timeoutMs);

// Identity of this machine used to decide "same node" (MORI_NODE_ID override).
std::string LocalNodeId();
std::string LocalHostname();

}  // namespace mori::io
