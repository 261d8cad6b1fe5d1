// Effective settings of one RDMA backend: RdmaBackendConfig with MORI's
// environment overrides applied, plus the verbs-level knobs that have no
// config field. Resolved and validated once, at create_backend().
#pragma once

#include <cstdint>
#include <string>

#include "io/common.hpp"

namespace mori::io::rdma {

constexpr int kMaxQpPerTransfer = 64;
constexpr int kMaxWorkerThreads = 64;
constexpr int kDefaultMaxSendWr = 8192;
constexpr int kDefaultMaxCqe = 16384;
constexpr int kDefaultMaxSge = 4;

struct RdmaSettings {
  RdmaBackendConfig config;  // after MORI_IO_* overrides

  std::string devices;            // MORI_RDMA_DEVICES
  int gidIndex = -1;              // MORI_IB_GID_INDEX (-1 = choose)
  int pathMtu = 0;                // MORI_IB_PATH_MTU in bytes (0 = port's active MTU)
  int serviceLevel = 0;           // MORI_IO_SL, else MORI_RDMA_SL
  int trafficClass = 0;           // MORI_IO_TC, else MORI_RDMA_TC
  int qpTimeout = 14;             // MORI_IO_QP_TIMEOUT: 4.096 us * 2^x per retry
  int retryCount = 7;             // MORI_IO_QP_RETRY_CNT
  int rnrRetry = 6;               // MORI_IO_QP_RNR_RETRY (7 would retry forever: refused)
  int minRnrTimer = 12;           // MORI_IO_QP_MIN_RNR_TIMER
  int maxInlineData = 64;         // MORI_IO_QP_MAX_INLINE_DATA
  bool relaxedOrdering = false;   // MORI_IB_ENABLE_RELAXED_ORDERING
  bool dmabuf = true;             // MORI_ENABLE_DMABUF_REG: GPU memory through dma-buf first
  int hostNicIndex = -1;          // MORI_IO_RDMA_NIC_IDX: pin host memory to one NIC
  int64_t sqBackoffTimeoutUs = 5000000;  // MORI_IO_SQ_BACKOFF_TIMEOUT_US
  int64_t controlTimeoutMs = 5000;       // MORI_IO_CP_TIMEOUT_MS
  int64_t stallTimeoutMs = 60000;        // MORI_IO_QP_STALL_TIMEOUT_MS (0 = off)
  std::string sysfsRoot = "/sys";        // MORI_IO_SYSFS_ROOT (tests point it at a fake tree)

  // Derived: what the backend actually uses.
  int maxSendWr() const { return config.maxSendWr > 0 ? config.maxSendWr : kDefaultMaxSendWr; }
  int maxCqe() const { return config.maxCqeNum > 0 ? config.maxCqeNum : kDefaultMaxCqe; }
  int maxSge() const { return config.maxMsgSge > 0 ? config.maxMsgSge : kDefaultMaxSge; }
  int workerThreads() const { return config.numWorkerThreads > 1 ? config.numWorkerThreads : 0; }
};

// Applies the environment to `config` and validates everything. Throws
// mori::InvalidArgument naming the field or variable and its allowed range.
RdmaSettings ResolveSettings(const RdmaBackendConfig& config);

// Bytes (256..4096) -> verbs MTU enum value (1..5); 0 when not a valid MTU.
int MtuEnumFromBytes(int bytes);

}  // namespace mori::io::rdma
