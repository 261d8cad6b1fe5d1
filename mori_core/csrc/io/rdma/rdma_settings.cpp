#include "io/rdma/rdma_settings.hpp"

#include "common/env.hpp"
#include "common/error.hpp"

namespace mori::io::rdma {
namespace {

void Check(bool ok, const std::string& what, int64_t value, const std::string& range) {
  if (!ok) throw InvalidArgument(what + "=" + std::to_string(value) + " must be " + range);
}

int64_t EnvOr(const char* primary, const char* secondary, int64_t fallback) {
  if (env::GetString(primary)) return env::GetInt(primary, fallback);
  return env::GetInt(secondary, fallback);
}

}  // namespace

int MtuEnumFromBytes(int bytes) {
  switch (bytes) {
    case 256: return 1;
    case 512: return 2;
    case 1024: return 3;
    case 2048: return 4;
    case 4096: return 5;
    default: return 0;
  }
}

RdmaSettings ResolveSettings(const RdmaBackendConfig& in) {
  RdmaSettings s;
  RdmaBackendConfig& c = s.config;
  c = in;
  // MORI applies every field's environment override at backend construction.
  c.qpPerTransfer = static_cast<int>(env::GetInt("MORI_IO_QP_PER_TRANSFER", c.qpPerTransfer));
  c.postBatchSize = static_cast<int>(env::GetInt("MORI_IO_POST_BATCH_SIZE", c.postBatchSize));
  c.numWorkerThreads = static_cast<int>(env::GetInt("MORI_IO_NUM_WORKER_THREADS", c.numWorkerThreads));
  if (auto m = env::GetString("MORI_IO_POLL_CQ_MODE")) {
    if (*m == "0" || *m == "polling" || *m == "POLLING") c.pollCqMode = PollCqMode::POLLING;
    else if (*m == "1" || *m == "event" || *m == "EVENT") c.pollCqMode = PollCqMode::EVENT;
    else throw InvalidArgument("MORI_IO_POLL_CQ_MODE='" + *m + "' must be 0/polling or 1/event");
  }
  c.enableNotification = env::GetBool("MORI_IO_ENABLE_NOTIFICATION", c.enableNotification);
  c.enableTransferChunking = env::GetBool("MORI_IO_ENABLE_CHUNKING", c.enableTransferChunking);
  c.chunkBytes = env::GetSize("MORI_IO_CHUNK_BYTES", c.chunkBytes);
  c.maxChunksPerTransfer = static_cast<int>(env::GetInt("MORI_IO_MAX_CHUNKS", c.maxChunksPerTransfer));
  c.numNicsPerTransfer = static_cast<int>(env::GetInt("MORI_IO_NUM_NICS_PER_TRANSFER", c.numNicsPerTransfer));
  c.maxSendWr = static_cast<int>(env::GetInt("MORI_IO_QP_MAX_SEND_WR", c.maxSendWr));
  c.maxCqeNum = static_cast<int>(env::GetInt("MORI_IO_QP_MAX_CQE", c.maxCqeNum));
  c.maxMsgSge = static_cast<int>(EnvOr("MORI_IO_QP_MAX_SGE", "MORI_IO_QP_MAX_MSG_SGE", c.maxMsgSge));

  Check(c.qpPerTransfer >= 1 && c.qpPerTransfer <= kMaxQpPerTransfer, "RdmaBackendConfig.qp_per_transfer",
        c.qpPerTransfer, "in [1, " + std::to_string(kMaxQpPerTransfer) + "] (MORI_IO_QP_PER_TRANSFER)");
  Check(c.postBatchSize == -1 || c.postBatchSize >= 1, "RdmaBackendConfig.post_batch_size", c.postBatchSize,
        "-1 (automatic) or >= 1 (MORI_IO_POST_BATCH_SIZE)");
  Check(c.numWorkerThreads >= -1 && c.numWorkerThreads <= kMaxWorkerThreads, "RdmaBackendConfig.num_worker_threads",
        c.numWorkerThreads,
        "-1/0/1 (post on the caller's thread) or up to " + std::to_string(kMaxWorkerThreads) +
            " (MORI_IO_NUM_WORKER_THREADS)");
  Check(c.notifPerQp >= 1 && c.notifPerQp <= 16384, "RdmaBackendConfig.notif_per_qp", c.notifPerQp,
        "in [1, 16384]");
  Check(c.chunkBytes >= 4096 && c.chunkBytes <= (1ull << 31), "RdmaBackendConfig.chunk_bytes",
        static_cast<int64_t>(c.chunkBytes), "in [4096, 2^31] (MORI_IO_CHUNK_BYTES)");
  Check(c.maxChunksPerTransfer >= 1 && c.maxChunksPerTransfer <= 65536, "RdmaBackendConfig.max_chunks_per_transfer",
        c.maxChunksPerTransfer, "in [1, 65536] (MORI_IO_MAX_CHUNKS)");
  Check(c.numNicsPerTransfer == 1, "RdmaBackendConfig.num_nics_per_transfer", c.numNicsPerTransfer,
        "1: striping one transfer over several NICs is not implemented by this backend");
  Check(c.maxSendWr == 0 || (c.maxSendWr >= 16 && c.maxSendWr <= 65536), "RdmaBackendConfig.max_send_wr",
        c.maxSendWr, "0 (default 8192) or in [16, 65536] (MORI_IO_QP_MAX_SEND_WR)");
  Check(c.maxCqeNum == 0 || (c.maxCqeNum >= 32 && c.maxCqeNum <= (1 << 22)), "RdmaBackendConfig.max_cqe_num",
        c.maxCqeNum, "0 (default 16384) or in [32, 4194304] (MORI_IO_QP_MAX_CQE)");
  Check(c.maxMsgSge == 0 || (c.maxMsgSge >= 1 && c.maxMsgSge <= 32), "RdmaBackendConfig.max_msg_sge", c.maxMsgSge,
        "0 (default 4) or in [1, 32] (MORI_IO_QP_MAX_SGE)");

  // One completion per signalled chain plus one per receive: a CQ smaller
  // than that could overrun, which breaks every QP on it.
  if (s.maxCqe() < s.maxSendWr() + 1 || s.maxCqe() < c.notifPerQp + 16)
    throw InvalidArgument("RdmaBackendConfig.max_cqe_num=" + std::to_string(s.maxCqe()) +
                          " must exceed both max_send_wr (" + std::to_string(s.maxSendWr()) + ") and notif_per_qp + 16 (" +
                          std::to_string(c.notifPerQp + 16) + ") (MORI_IO_QP_MAX_CQE)");

  if (auto d = env::GetString("MORI_RDMA_DEVICES")) s.devices = *d;
  s.gidIndex = static_cast<int>(env::GetInt("MORI_IB_GID_INDEX", s.gidIndex));
  Check(s.gidIndex >= -1 && s.gidIndex <= 255, "MORI_IB_GID_INDEX", s.gidIndex, "in [0, 255] (or unset)");
  s.pathMtu = static_cast<int>(env::GetInt("MORI_IB_PATH_MTU", s.pathMtu));
  Check(s.pathMtu == 0 || MtuEnumFromBytes(s.pathMtu) != 0, "MORI_IB_PATH_MTU", s.pathMtu,
        "one of 256, 512, 1024, 2048, 4096");
  s.serviceLevel = static_cast<int>(EnvOr("MORI_IO_SL", "MORI_RDMA_SL", s.serviceLevel));
  Check(s.serviceLevel >= 0 && s.serviceLevel <= 15, "MORI_IO_SL", s.serviceLevel, "in [0, 15]");
  s.trafficClass = static_cast<int>(EnvOr("MORI_IO_TC", "MORI_RDMA_TC", s.trafficClass));
  Check(s.trafficClass >= 0 && s.trafficClass <= 255, "MORI_IO_TC", s.trafficClass, "in [0, 255]");
  s.qpTimeout = static_cast<int>(env::GetInt("MORI_IO_QP_TIMEOUT", s.qpTimeout));
  Check(s.qpTimeout >= 1 && s.qpTimeout <= 31, "MORI_IO_QP_TIMEOUT", s.qpTimeout,
        "in [1, 31] (0 = wait forever is refused)");
  s.retryCount = static_cast<int>(env::GetInt("MORI_IO_QP_RETRY_CNT", s.retryCount));
  Check(s.retryCount >= 0 && s.retryCount <= 7, "MORI_IO_QP_RETRY_CNT", s.retryCount, "in [0, 7]");
  s.rnrRetry = static_cast<int>(env::GetInt("MORI_IO_QP_RNR_RETRY", s.rnrRetry));
  Check(s.rnrRetry >= 0 && s.rnrRetry <= 6, "MORI_IO_QP_RNR_RETRY", s.rnrRetry,
        "in [0, 6] (7 = retry forever would let one stuck target hang transfers)");
  s.minRnrTimer = static_cast<int>(env::GetInt("MORI_IO_QP_MIN_RNR_TIMER", s.minRnrTimer));
  Check(s.minRnrTimer >= 1 && s.minRnrTimer <= 31, "MORI_IO_QP_MIN_RNR_TIMER", s.minRnrTimer, "in [1, 31]");
  s.maxInlineData = static_cast<int>(env::GetInt("MORI_IO_QP_MAX_INLINE_DATA", s.maxInlineData));
  Check(s.maxInlineData >= 0 && s.maxInlineData <= 1024, "MORI_IO_QP_MAX_INLINE_DATA", s.maxInlineData,
        "in [0, 1024]");
  s.relaxedOrdering = env::GetBool("MORI_IB_ENABLE_RELAXED_ORDERING", s.relaxedOrdering);
  s.dmabuf = env::GetBool("MORI_ENABLE_DMABUF_REG", s.dmabuf);
  s.hostNicIndex = static_cast<int>(env::GetInt("MORI_IO_RDMA_NIC_IDX", s.hostNicIndex));
  Check(s.hostNicIndex >= -1, "MORI_IO_RDMA_NIC_IDX", s.hostNicIndex, ">= 0 (or unset)");
  s.sqBackoffTimeoutUs = env::GetInt("MORI_IO_SQ_BACKOFF_TIMEOUT_US", s.sqBackoffTimeoutUs);
  Check(s.sqBackoffTimeoutUs >= 1000, "MORI_IO_SQ_BACKOFF_TIMEOUT_US", s.sqBackoffTimeoutUs, ">= 1000");
  s.controlTimeoutMs = env::GetInt("MORI_IO_CP_TIMEOUT_MS", s.controlTimeoutMs);
  Check(s.controlTimeoutMs >= 10, "MORI_IO_CP_TIMEOUT_MS", s.controlTimeoutMs, ">= 10");
  s.stallTimeoutMs = env::GetInt("MORI_IO_QP_STALL_TIMEOUT_MS", s.stallTimeoutMs);
  Check(s.stallTimeoutMs == 0 || s.stallTimeoutMs >= 100, "MORI_IO_QP_STALL_TIMEOUT_MS", s.stallTimeoutMs,
        "0 (off) or >= 100");
  if (auto r = env::GetString("MORI_IO_SYSFS_ROOT")) s.sysfsRoot = *r;
  return s;
}

}  // namespace mori::io::rdma
