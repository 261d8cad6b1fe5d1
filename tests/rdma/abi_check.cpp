// Compile-time proof that mori_core/csrc/io/rdma/verbs_abi.hpp matches the
// real <infiniband/verbs.h>: every size, offset and constant the backend
// relies on. Built (never run) by test_verbs_abi.py where rdma-core's headers
// are installed (Debian/Ubuntu: libibverbs-dev).
#include <infiniband/verbs.h>

#include <cstddef>
#include <type_traits>

#include "io/rdma/verbs_abi.hpp"

namespace A = mori::io::rdma::abi;

#define SAME_SIZE(T) static_assert(sizeof(::T) == sizeof(A::T), "size of " #T);
#define SAME_OFF(T, f) static_assert(offsetof(::T, f) == offsetof(A::T, f), "offset of " #T "." #f);
#define SAME_VAL(e) static_assert(static_cast<long>(::e) == static_cast<long>(A::e), "value of " #e);

SAME_SIZE(ibv_gid)
SAME_SIZE(ibv_device_attr)
SAME_OFF(ibv_device_attr, max_qp_wr)
SAME_OFF(ibv_device_attr, max_sge)
SAME_OFF(ibv_device_attr, max_cqe)
SAME_OFF(ibv_device_attr, max_qp_rd_atom)
SAME_OFF(ibv_device_attr, max_qp_init_rd_atom)
SAME_OFF(ibv_device_attr, phys_port_cnt)

SAME_SIZE(ibv_port_attr)
SAME_OFF(ibv_port_attr, state)
SAME_OFF(ibv_port_attr, active_mtu)
SAME_OFF(ibv_port_attr, gid_tbl_len)
SAME_OFF(ibv_port_attr, max_msg_sz)
SAME_OFF(ibv_port_attr, lid)
SAME_OFF(ibv_port_attr, link_layer)

SAME_SIZE(ibv_global_route)
SAME_SIZE(ibv_ah_attr)
SAME_OFF(ibv_ah_attr, grh.dgid)
SAME_OFF(ibv_ah_attr, grh.sgid_index)
SAME_OFF(ibv_ah_attr, grh.hop_limit)
SAME_OFF(ibv_ah_attr, grh.traffic_class)
SAME_OFF(ibv_ah_attr, dlid)
SAME_OFF(ibv_ah_attr, sl)
SAME_OFF(ibv_ah_attr, is_global)
SAME_OFF(ibv_ah_attr, port_num)

SAME_SIZE(ibv_qp_cap)
SAME_SIZE(ibv_qp_init_attr)
SAME_OFF(ibv_qp_init_attr, send_cq)
SAME_OFF(ibv_qp_init_attr, recv_cq)
SAME_OFF(ibv_qp_init_attr, cap)
SAME_OFF(ibv_qp_init_attr, qp_type)
SAME_OFF(ibv_qp_init_attr, sq_sig_all)

SAME_SIZE(ibv_qp_attr)
SAME_OFF(ibv_qp_attr, qp_state)
SAME_OFF(ibv_qp_attr, path_mtu)
SAME_OFF(ibv_qp_attr, rq_psn)
SAME_OFF(ibv_qp_attr, sq_psn)
SAME_OFF(ibv_qp_attr, dest_qp_num)
SAME_OFF(ibv_qp_attr, qp_access_flags)
SAME_OFF(ibv_qp_attr, ah_attr)
SAME_OFF(ibv_qp_attr, pkey_index)
SAME_OFF(ibv_qp_attr, max_rd_atomic)
SAME_OFF(ibv_qp_attr, max_dest_rd_atomic)
SAME_OFF(ibv_qp_attr, min_rnr_timer)
SAME_OFF(ibv_qp_attr, port_num)
SAME_OFF(ibv_qp_attr, timeout)
SAME_OFF(ibv_qp_attr, retry_cnt)
SAME_OFF(ibv_qp_attr, rnr_retry)

SAME_SIZE(ibv_sge)
SAME_SIZE(ibv_send_wr)
SAME_OFF(ibv_send_wr, wr_id)
SAME_OFF(ibv_send_wr, next)
SAME_OFF(ibv_send_wr, sg_list)
SAME_OFF(ibv_send_wr, num_sge)
SAME_OFF(ibv_send_wr, opcode)
SAME_OFF(ibv_send_wr, send_flags)
SAME_OFF(ibv_send_wr, imm_data)
SAME_OFF(ibv_send_wr, wr.rdma.remote_addr)
SAME_OFF(ibv_send_wr, wr.rdma.rkey)
SAME_SIZE(ibv_recv_wr)
SAME_OFF(ibv_recv_wr, sg_list)
SAME_OFF(ibv_recv_wr, num_sge)

SAME_SIZE(ibv_wc)
SAME_OFF(ibv_wc, status)
SAME_OFF(ibv_wc, opcode)
SAME_OFF(ibv_wc, vendor_err)
SAME_OFF(ibv_wc, byte_len)
SAME_OFF(ibv_wc, qp_num)

SAME_SIZE(ibv_context_ops)
SAME_OFF(ibv_context_ops, poll_cq)
SAME_OFF(ibv_context_ops, req_notify_cq)
SAME_OFF(ibv_context_ops, post_send)
SAME_OFF(ibv_context_ops, post_recv)
SAME_SIZE(ibv_context)
SAME_OFF(ibv_context, ops)
SAME_OFF(ibv_context, async_fd)
SAME_SIZE(ibv_pd)
SAME_SIZE(ibv_mr)
SAME_OFF(ibv_mr, lkey)
SAME_OFF(ibv_mr, rkey)
SAME_SIZE(ibv_comp_channel)
SAME_OFF(ibv_comp_channel, fd)
SAME_SIZE(ibv_cq)
SAME_OFF(ibv_cq, context)
SAME_OFF(ibv_cq, cq_context)
SAME_SIZE(ibv_qp)
SAME_OFF(ibv_qp, context)
SAME_OFF(ibv_qp, qp_num)
SAME_OFF(ibv_qp, state)

SAME_VAL(IBV_MTU_256)
SAME_VAL(IBV_MTU_4096)
SAME_VAL(IBV_PORT_ACTIVE)
SAME_VAL(IBV_LINK_LAYER_INFINIBAND)
SAME_VAL(IBV_LINK_LAYER_ETHERNET)
SAME_VAL(IBV_QPT_RC)
SAME_VAL(IBV_QPS_INIT)
SAME_VAL(IBV_QPS_RTR)
SAME_VAL(IBV_QPS_RTS)
SAME_VAL(IBV_QPS_ERR)
SAME_VAL(IBV_QP_STATE)
SAME_VAL(IBV_QP_ACCESS_FLAGS)
SAME_VAL(IBV_QP_PKEY_INDEX)
SAME_VAL(IBV_QP_PORT)
SAME_VAL(IBV_QP_AV)
SAME_VAL(IBV_QP_PATH_MTU)
SAME_VAL(IBV_QP_TIMEOUT)
SAME_VAL(IBV_QP_RETRY_CNT)
SAME_VAL(IBV_QP_RNR_RETRY)
SAME_VAL(IBV_QP_RQ_PSN)
SAME_VAL(IBV_QP_MAX_QP_RD_ATOMIC)
SAME_VAL(IBV_QP_MIN_RNR_TIMER)
SAME_VAL(IBV_QP_SQ_PSN)
SAME_VAL(IBV_QP_MAX_DEST_RD_ATOMIC)
SAME_VAL(IBV_QP_DEST_QPN)
SAME_VAL(IBV_ACCESS_LOCAL_WRITE)
SAME_VAL(IBV_ACCESS_REMOTE_WRITE)
SAME_VAL(IBV_ACCESS_REMOTE_READ)
SAME_VAL(IBV_ACCESS_RELAXED_ORDERING)
SAME_VAL(IBV_WR_RDMA_WRITE)
SAME_VAL(IBV_WR_SEND)
SAME_VAL(IBV_WR_RDMA_READ)
SAME_VAL(IBV_SEND_FENCE)
SAME_VAL(IBV_SEND_SIGNALED)
SAME_VAL(IBV_SEND_INLINE)
SAME_VAL(IBV_WC_SUCCESS)
SAME_VAL(IBV_WC_WR_FLUSH_ERR)
SAME_VAL(IBV_WC_REM_ACCESS_ERR)
SAME_VAL(IBV_WC_RETRY_EXC_ERR)
SAME_VAL(IBV_WC_RNR_RETRY_EXC_ERR)
SAME_VAL(IBV_WC_RESP_TIMEOUT_ERR)
SAME_VAL(IBV_WC_RECV)

// The exported functions we resolve with dlsym have the signatures we call them with.
static_assert(std::is_same_v<decltype(&::ibv_get_device_name), const char* (*)(::ibv_device*)>);
static_assert(std::is_same_v<decltype(&::ibv_reg_mr), ::ibv_mr* (*)(::ibv_pd*, void*, size_t, int)>);
static_assert(std::is_same_v<decltype(&::ibv_reg_dmabuf_mr),
                             ::ibv_mr* (*)(::ibv_pd*, uint64_t, size_t, uint64_t, int, int)>);
static_assert(std::is_same_v<decltype(&::ibv_reg_mr_iova2),
                             ::ibv_mr* (*)(::ibv_pd*, void*, size_t, uint64_t, unsigned int)>);
static_assert(std::is_same_v<decltype(&::ibv_create_cq),
                             ::ibv_cq* (*)(::ibv_context*, int, void*, ::ibv_comp_channel*, int)>);
static_assert(std::is_same_v<decltype(&::ibv_modify_qp), int (*)(::ibv_qp*, ::ibv_qp_attr*, int)>);
static_assert(std::is_same_v<decltype(&::ibv_get_cq_event), int (*)(::ibv_comp_channel*, ::ibv_cq**, void**)>);
static_assert(std::is_same_v<decltype(&::ibv_query_gid), int (*)(::ibv_context*, uint8_t, int, ::ibv_gid*)>);

int main() { return 0; }
