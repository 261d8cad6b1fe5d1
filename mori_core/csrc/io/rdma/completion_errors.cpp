#include "io/rdma/completion_errors.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "io/rdma/verbs_abi.hpp"

namespace mori::io::rdma {

using namespace abi;

std::string DescribeCompletionError(int status, uint32_t vendorErr, bool isRead, bool isNotification) {
  const char* what = isNotification ? "notification send" : (isRead ? "RDMA read" : "RDMA write");
  std::string head = std::string(what) + " failed: ";
  std::string tail = " (ibv_wc_status " + std::to_string(status) + ", vendor error 0x" + [&] {
    char b[16];
    std::snprintf(b, sizeof(b), "%x", vendorErr);
    return std::string(b);
  }() + ")";
  switch (status) {
    case IBV_WC_RETRY_EXC_ERR:
      return head +
             "transport retry counter exceeded — the peer stopped acknowledging (peer process or host died, link "
             "down, or the QPs cannot reach each other: check MORI_RDMA_DEVICES and, on RoCE, MORI_IB_GID_INDEX; "
             "on congested fabrics raise MORI_IO_QP_TIMEOUT / MORI_IO_QP_RETRY_CNT)" + tail;
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return head +
             "receiver not ready — the target had no notification buffer posted (raise "
             "RdmaBackendConfig.notif_per_qp on the target, or MORI_IO_QP_RNR_RETRY / MORI_IO_QP_MIN_RNR_TIMER)" +
             tail;
    case IBV_WC_REM_ACCESS_ERR:
      return head +
             "remote access error — the remote region was deregistered or is smaller than the descriptor says "
             "(use a fresh MemoryDesc from the peer)" + tail;
    case IBV_WC_REM_INV_REQ_ERR:
      return head + "the target rejected the request as invalid (message larger than the port's max_msg_sz, or "
                    "the remote QP is misconfigured)" + tail;
    case IBV_WC_REM_OP_ERR:
      return head + "the target could not complete the operation (its QP went to the error state)" + tail;
    case IBV_WC_LOC_PROT_ERR:
      return head + "local protection error — the local buffer is not covered by its memory region "
                    "(deregistered while in use?)" + tail;
    case IBV_WC_LOC_LEN_ERR:
      return head + "local length error (notification larger than the target's receive buffer, or an SGE exceeds "
                    "its region)" + tail;
    case IBV_WC_LOC_QP_OP_ERR:
      return head + "local QP operation error (work request exceeds the QP's limits: lower "
                    "RdmaBackendConfig.max_msg_sge or MORI_IO_QP_MAX_INLINE_DATA)" + tail;
    case IBV_WC_LOC_ACCESS_ERR:
      return head + "local access error — the local memory region lacks write access" + tail;
    case IBV_WC_WR_FLUSH_ERR:
      return head +
             "flushed: an earlier work request on the same queue pair failed (or it was torn down), so this one "
             "was never executed; the connection is rebuilt on the next transfer" + tail;
    case IBV_WC_BAD_RESP_ERR:
      return head + "unexpected response from the target (mismatched QP setup?)" + tail;
    case IBV_WC_REM_ABORT_ERR:
      return head + "the target aborted the operation" + tail;
    case IBV_WC_FATAL_ERR:
      return head + "fatal device error — check the NIC with `ibv_devinfo` and dmesg" + tail;
    case IBV_WC_RESP_TIMEOUT_ERR:
      return head + "response timeout (raise MORI_IO_QP_TIMEOUT on slow fabrics)" + tail;
    default:
      return head + "completion error" + tail;
  }
}

std::string DescribeSendQueueFull(uint32_t sqDepth, uint32_t needed, int64_t waitedUs) {
  return "RDMA send queue stayed full for " + std::to_string(waitedUs) + " us (" + std::to_string(needed) +
         " slots needed, depth " + std::to_string(sqDepth) +
         "): completions are not coming back fast enough — raise RdmaBackendConfig.max_send_wr "
         "(MORI_IO_QP_MAX_SEND_WR) or qp_per_transfer, lower post_batch_size, or raise "
         "MORI_IO_SQ_BACKOFF_TIMEOUT_US";
}

std::string DescribePostFailure(int err) {
  std::string s = "ibv_post_send failed: " + std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
  if (err == ENOMEM)
    s += " — the send queue is full (raise RdmaBackendConfig.max_send_wr / MORI_IO_QP_MAX_SEND_WR)";
  else if (err == EINVAL)
    s += " — the work request exceeds the QP's limits or the QP is not ready (MORI_IO_QP_MAX_SGE, "
         "MORI_IO_QP_MAX_INLINE_DATA)";
  return s;
}

}  // namespace mori::io::rdma
