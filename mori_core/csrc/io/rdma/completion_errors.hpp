// Readable, actionable texts for failed work completions and posting
// problems: what happened, the likely cause, and which knob to turn.
#pragma once

#include <cstdint>
#include <string>

namespace mori::io::rdma {

// `status` is an ibv_wc_status value; `vendorErr` the provider's code.
std::string DescribeCompletionError(int status, uint32_t vendorErr, bool isRead, bool isNotification);

// The send queue stayed full for the whole backoff window.
std::string DescribeSendQueueFull(uint32_t sqDepth, uint32_t needed, int64_t waitedUs);

// ibv_post_send itself failed with errno `err`.
std::string DescribePostFailure(int err);

}  // namespace mori::io::rdma
