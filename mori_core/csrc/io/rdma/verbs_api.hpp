// libibverbs, opened at run time.
//
// The library is looked up once per process with dlopen("libibverbs.so.1")
// (or the path in MORI_IBVERBS_LIBRARY). When it is missing, or too old to
// carry a symbol we need, Verbs() returns nullptr and VerbsLoadError() says
// what is missing and what to install — the rest of the core is unaffected.
#pragma once

#include <string>

#include "io/rdma/verbs_abi.hpp"

namespace mori::io::rdma {

struct VerbsApi {
  abi::fn_get_device_list get_device_list = nullptr;
  abi::fn_free_device_list free_device_list = nullptr;
  abi::fn_get_device_name get_device_name = nullptr;
  abi::fn_open_device open_device = nullptr;
  abi::fn_close_device close_device = nullptr;
  abi::fn_query_device query_device = nullptr;
  abi::fn_query_port query_port = nullptr;
  abi::fn_query_gid query_gid = nullptr;
  abi::fn_alloc_pd alloc_pd = nullptr;
  abi::fn_dealloc_pd dealloc_pd = nullptr;
  abi::fn_reg_mr reg_mr = nullptr;
  abi::fn_reg_mr_iova2 reg_mr_iova2 = nullptr;      // optional (rdma-core >= 26)
  abi::fn_reg_dmabuf_mr reg_dmabuf_mr = nullptr;    // optional (rdma-core >= 34)
  abi::fn_dereg_mr dereg_mr = nullptr;
  abi::fn_create_comp_channel create_comp_channel = nullptr;
  abi::fn_destroy_comp_channel destroy_comp_channel = nullptr;
  abi::fn_create_cq create_cq = nullptr;
  abi::fn_destroy_cq destroy_cq = nullptr;
  abi::fn_get_cq_event get_cq_event = nullptr;
  abi::fn_ack_cq_events ack_cq_events = nullptr;
  abi::fn_create_qp create_qp = nullptr;
  abi::fn_modify_qp modify_qp = nullptr;
  abi::fn_destroy_qp destroy_qp = nullptr;
  abi::fn_wc_status_str wc_status_str = nullptr;
  std::string libraryPath;  // what was opened

  // The inline fast paths of verbs.h: straight through the provider's ops.
  static int PostSend(abi::ibv_qp* qp, abi::ibv_send_wr* wr, abi::ibv_send_wr** bad) {
    return qp->context->ops.post_send(qp, wr, bad);
  }
  static int PostRecv(abi::ibv_qp* qp, abi::ibv_recv_wr* wr, abi::ibv_recv_wr** bad) {
    return qp->context->ops.post_recv(qp, wr, bad);
  }
  static int PollCq(abi::ibv_cq* cq, int n, abi::ibv_wc* wc) { return cq->context->ops.poll_cq(cq, n, wc); }
  static int ReqNotifyCq(abi::ibv_cq* cq, int solicitedOnly) {
    return cq->context->ops.req_notify_cq(cq, solicitedOnly);
  }
};

// The process-wide table, loaded on first call; nullptr when unavailable.
const VerbsApi* Verbs();
// Why Verbs() returned nullptr ("" when it did not).
std::string VerbsLoadError();

}  // namespace mori::io::rdma
