// Our own declarations of the parts of the libibverbs ABI the RDMA backend uses.
//
// Why not <infiniband/verbs.h>: the core must build on machines without
// rdma-core headers and import on machines without libibverbs, so the library
// is opened with dlopen at run time and only these declarations are compiled
// in. Everything here mirrors the stable ABI of libibverbs.so.1 (rdma-core
// >= v22; the layouts have not changed since IBVERBS_1.1). Names are kept
// identical to verbs.h, inside a namespace, so the two can be compared field
// by field: tests/rdma/abi_check.cpp static_asserts every offset below
// against the real header where one is installed.
//
// ibv_post_send / ibv_post_recv / ibv_poll_cq / ibv_req_notify_cq are inline
// functions in verbs.h that jump through `context->ops`; they are reproduced
// in verbs_api.hpp on top of the ops table declared here.
#pragma once

#include <pthread.h>

#include <cstddef>
#include <cstdint>

namespace mori::io::rdma::abi {

// ------------------------------------------------------------------ enums
enum ibv_mtu : int { IBV_MTU_256 = 1, IBV_MTU_512 = 2, IBV_MTU_1024 = 3, IBV_MTU_2048 = 4, IBV_MTU_4096 = 5 };

enum ibv_port_state : int {
  IBV_PORT_NOP = 0,
  IBV_PORT_DOWN = 1,
  IBV_PORT_INIT = 2,
  IBV_PORT_ARMED = 3,
  IBV_PORT_ACTIVE = 4,
  IBV_PORT_ACTIVE_DEFER = 5
};

enum : uint8_t { IBV_LINK_LAYER_UNSPECIFIED = 0, IBV_LINK_LAYER_INFINIBAND = 1, IBV_LINK_LAYER_ETHERNET = 2 };

enum ibv_qp_type : int { IBV_QPT_RC = 2, IBV_QPT_UC = 3, IBV_QPT_UD = 4 };

enum ibv_qp_state : int {
  IBV_QPS_RESET,
  IBV_QPS_INIT,
  IBV_QPS_RTR,
  IBV_QPS_RTS,
  IBV_QPS_SQD,
  IBV_QPS_SQE,
  IBV_QPS_ERR,
  IBV_QPS_UNKNOWN
};

enum ibv_mig_state : int { IBV_MIG_MIGRATED, IBV_MIG_REARM, IBV_MIG_ARMED };

enum ibv_qp_attr_mask : int {
  IBV_QP_STATE = 1 << 0,
  IBV_QP_CUR_STATE = 1 << 1,
  IBV_QP_EN_SQD_ASYNC_NOTIFY = 1 << 2,
  IBV_QP_ACCESS_FLAGS = 1 << 3,
  IBV_QP_PKEY_INDEX = 1 << 4,
  IBV_QP_PORT = 1 << 5,
  IBV_QP_QKEY = 1 << 6,
  IBV_QP_AV = 1 << 7,
  IBV_QP_PATH_MTU = 1 << 8,
  IBV_QP_TIMEOUT = 1 << 9,
  IBV_QP_RETRY_CNT = 1 << 10,
  IBV_QP_RNR_RETRY = 1 << 11,
  IBV_QP_RQ_PSN = 1 << 12,
  IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
  IBV_QP_ALT_PATH = 1 << 14,
  IBV_QP_MIN_RNR_TIMER = 1 << 15,
  IBV_QP_SQ_PSN = 1 << 16,
  IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
  IBV_QP_PATH_MIG_STATE = 1 << 18,
  IBV_QP_CAP = 1 << 19,
  IBV_QP_DEST_QPN = 1 << 20,
};

enum ibv_access_flags : int {
  IBV_ACCESS_LOCAL_WRITE = 1,
  IBV_ACCESS_REMOTE_WRITE = 1 << 1,
  IBV_ACCESS_REMOTE_READ = 1 << 2,
  IBV_ACCESS_REMOTE_ATOMIC = 1 << 3,
  IBV_ACCESS_RELAXED_ORDERING = 1 << 20,  // IBV_ACCESS_OPTIONAL_FIRST
};

enum ibv_wr_opcode : int {
  IBV_WR_RDMA_WRITE = 0,
  IBV_WR_RDMA_WRITE_WITH_IMM = 1,
  IBV_WR_SEND = 2,
  IBV_WR_SEND_WITH_IMM = 3,
  IBV_WR_RDMA_READ = 4,
};

enum ibv_send_flags : unsigned {
  IBV_SEND_FENCE = 1 << 0,
  IBV_SEND_SIGNALED = 1 << 1,
  IBV_SEND_SOLICITED = 1 << 2,
  IBV_SEND_INLINE = 1 << 3,
};

enum ibv_wc_status : int {
  IBV_WC_SUCCESS,
  IBV_WC_LOC_LEN_ERR,
  IBV_WC_LOC_QP_OP_ERR,
  IBV_WC_LOC_EEC_OP_ERR,
  IBV_WC_LOC_PROT_ERR,
  IBV_WC_WR_FLUSH_ERR,
  IBV_WC_MW_BIND_ERR,
  IBV_WC_BAD_RESP_ERR,
  IBV_WC_LOC_ACCESS_ERR,
  IBV_WC_REM_INV_REQ_ERR,
  IBV_WC_REM_ACCESS_ERR,
  IBV_WC_REM_OP_ERR,
  IBV_WC_RETRY_EXC_ERR,
  IBV_WC_RNR_RETRY_EXC_ERR,
  IBV_WC_LOC_RDD_VIOL_ERR,
  IBV_WC_REM_INV_RD_REQ_ERR,
  IBV_WC_REM_ABORT_ERR,
  IBV_WC_INV_EECN_ERR,
  IBV_WC_INV_EEC_STATE_ERR,
  IBV_WC_FATAL_ERR,
  IBV_WC_RESP_TIMEOUT_ERR,
  IBV_WC_GENERAL_ERR,
  IBV_WC_TM_ERR,
  IBV_WC_TM_RNDV_INCOMPLETE,
};

enum ibv_wc_opcode : int {
  IBV_WC_SEND = 0,
  IBV_WC_RDMA_WRITE = 1,
  IBV_WC_RDMA_READ = 2,
  IBV_WC_RECV = 1 << 7,
  IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1,
};

// --------------------------------------------------------------- structs
struct ibv_context;
struct ibv_pd;
struct ibv_cq;
struct ibv_qp;
struct ibv_srq;
struct ibv_mw;
struct ibv_ah;
struct ibv_comp_channel;

// Opaque to us: only handed back to the library.
struct ibv_device;

union ibv_gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix;  // big endian
    uint64_t interface_id;   // big endian
  } global;
};

struct ibv_device_attr {
  char fw_ver[64];
  uint64_t node_guid;
  uint64_t sys_image_guid;
  uint64_t max_mr_size;
  uint64_t page_size_cap;
  uint32_t vendor_id;
  uint32_t vendor_part_id;
  uint32_t hw_ver;
  int max_qp;
  int max_qp_wr;
  unsigned int device_cap_flags;
  int max_sge;
  int max_sge_rd;
  int max_cq;
  int max_cqe;
  int max_mr;
  int max_pd;
  int max_qp_rd_atom;
  int max_ee_rd_atom;
  int max_res_rd_atom;
  int max_qp_init_rd_atom;
  int max_ee_init_rd_atom;
  int atomic_cap;
  int max_ee;
  int max_rdd;
  int max_mw;
  int max_raw_ipv6_qp;
  int max_raw_ethy_qp;
  int max_mcast_grp;
  int max_mcast_qp_attach;
  int max_total_mcast_qp_attach;
  int max_ah;
  int max_fmr;
  int max_map_per_fmr;
  int max_srq;
  int max_srq_wr;
  int max_srq_sge;
  uint16_t max_pkeys;
  uint8_t local_ca_ack_delay;
  uint8_t phys_port_cnt;
};

struct ibv_port_attr {
  ibv_port_state state;
  ibv_mtu max_mtu;
  ibv_mtu active_mtu;
  int gid_tbl_len;
  uint32_t port_cap_flags;
  uint32_t max_msg_sz;
  uint32_t bad_pkey_cntr;
  uint32_t qkey_viol_cntr;
  uint16_t pkey_tbl_len;
  uint16_t lid;
  uint16_t sm_lid;
  uint8_t lmc;
  uint8_t max_vl_num;
  uint8_t sm_sl;
  uint8_t subnet_timeout;
  uint8_t init_type_reply;
  uint8_t active_width;
  uint8_t active_speed;
  uint8_t phys_state;
  uint8_t link_layer;
  uint8_t flags;
  uint16_t port_cap_flags2;
};

struct ibv_global_route {
  ibv_gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

struct ibv_ah_attr {
  ibv_global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

struct ibv_qp_cap {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
  void* qp_context;
  ibv_cq* send_cq;
  ibv_cq* recv_cq;
  ibv_srq* srq;
  ibv_qp_cap cap;
  ibv_qp_type qp_type;
  int sq_sig_all;
};

struct ibv_qp_attr {
  ibv_qp_state qp_state;
  ibv_qp_state cur_qp_state;
  ibv_mtu path_mtu;
  ibv_mig_state path_mig_state;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  unsigned int qp_access_flags;
  ibv_qp_cap cap;
  ibv_ah_attr ah_attr;
  ibv_ah_attr alt_ah_attr;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

struct ibv_sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

struct ibv_mr;

struct ibv_mw_bind_info {
  ibv_mr* mr;
  uint64_t addr;
  uint64_t length;
  unsigned int mw_access_flags;
};

struct ibv_send_wr {
  uint64_t wr_id;
  ibv_send_wr* next;
  ibv_sge* sg_list;
  int num_sge;
  ibv_wr_opcode opcode;
  unsigned int send_flags;
  union {
    uint32_t imm_data;  // network byte order
    uint32_t invalidate_rkey;
  };
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    struct {
      uint64_t remote_addr;
      uint64_t compare_add;
      uint64_t swap;
      uint32_t rkey;
    } atomic;
    struct {
      ibv_ah* ah;
      uint32_t remote_qpn;
      uint32_t remote_qkey;
    } ud;
  } wr;
  union {
    struct {
      uint32_t remote_srqn;
    } xrc;
  } qp_type;
  union {
    struct {
      ibv_mw* mw;
      uint32_t rkey;
      ibv_mw_bind_info bind_info;
    } bind_mw;
    struct {
      void* hdr;
      uint16_t hdr_sz;
      uint16_t mss;
    } tso;
  };
};

struct ibv_recv_wr {
  uint64_t wr_id;
  ibv_recv_wr* next;
  ibv_sge* sg_list;
  int num_sge;
};

struct ibv_wc {
  uint64_t wr_id;
  ibv_wc_status status;
  ibv_wc_opcode opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  union {
    uint32_t imm_data;
    uint32_t invalidated_rkey;
  };
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned int wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

// The provider's fast-path entry points; verbs.h's inline helpers call these.
struct ibv_context_ops {
  void* _compat_query_device;
  void* _compat_query_port;
  void* _compat_alloc_pd;
  void* _compat_dealloc_pd;
  void* _compat_reg_mr;
  void* _compat_rereg_mr;
  void* _compat_dereg_mr;
  void* alloc_mw;
  void* bind_mw;
  void* dealloc_mw;
  void* _compat_create_cq;
  int (*poll_cq)(ibv_cq* cq, int num_entries, ibv_wc* wc);
  int (*req_notify_cq)(ibv_cq* cq, int solicited_only);
  void* _compat_cq_event;
  void* _compat_resize_cq;
  void* _compat_destroy_cq;
  void* _compat_create_srq;
  void* _compat_modify_srq;
  void* _compat_query_srq;
  void* _compat_destroy_srq;
  void* post_srq_recv;
  void* _compat_create_qp;
  void* _compat_query_qp;
  void* _compat_modify_qp;
  void* _compat_destroy_qp;
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr);
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
  void* _compat_create_ah;
  void* _compat_destroy_ah;
  void* _compat_attach_mcast;
  void* _compat_detach_mcast;
  void* _compat_async_event;
};

struct ibv_context {
  ibv_device* device;
  ibv_context_ops ops;
  int cmd_fd;
  int async_fd;
  int num_comp_vectors;
  pthread_mutex_t mutex;
  void* abi_compat;
};

struct ibv_pd {
  ibv_context* context;
  uint32_t handle;
};

struct ibv_mr {
  ibv_context* context;
  ibv_pd* pd;
  void* addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

struct ibv_comp_channel {
  ibv_context* context;
  int fd;
  int refcnt;
};

struct ibv_cq {
  ibv_context* context;
  ibv_comp_channel* channel;
  void* cq_context;
  uint32_t handle;
  int cqe;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t comp_events_completed;
  uint32_t async_events_completed;
};

struct ibv_qp {
  ibv_context* context;
  void* qp_context;
  ibv_pd* pd;
  ibv_cq* send_cq;
  ibv_cq* recv_cq;
  ibv_srq* srq;
  uint32_t handle;
  uint32_t qp_num;
  ibv_qp_state state;
  ibv_qp_type qp_type;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t events_completed;
};

static_assert(sizeof(ibv_send_wr) == 128, "ibv_send_wr must match the libibverbs ABI");
static_assert(sizeof(ibv_wc) == 48, "ibv_wc must match the libibverbs ABI");
static_assert(sizeof(ibv_sge) == 16, "ibv_sge must match the libibverbs ABI");
static_assert(offsetof(ibv_context_ops, post_send) == 25 * sizeof(void*), "ibv_context_ops layout");

// ---------------------------------------------------- exported functions
// Signatures of the symbols resolved with dlsym (IBVERBS_1.1 unless noted).
using fn_get_device_list = ibv_device** (*)(int* num_devices);
using fn_free_device_list = void (*)(ibv_device** list);
using fn_get_device_name = const char* (*)(ibv_device* device);
using fn_open_device = ibv_context* (*)(ibv_device* device);
using fn_close_device = int (*)(ibv_context* context);
using fn_query_device = int (*)(ibv_context* context, ibv_device_attr* attr);
// The exported symbol takes the compat (prefix) layout; callers zero the full struct first.
using fn_query_port = int (*)(ibv_context* context, uint8_t port_num, ibv_port_attr* attr);
using fn_query_gid = int (*)(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid);
using fn_alloc_pd = ibv_pd* (*)(ibv_context* context);
using fn_dealloc_pd = int (*)(ibv_pd* pd);
using fn_reg_mr = ibv_mr* (*)(ibv_pd* pd, void* addr, size_t length, int access);
using fn_reg_mr_iova2 = ibv_mr* (*)(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                                    unsigned int access);                       // IBVERBS_1.8
using fn_reg_dmabuf_mr = ibv_mr* (*)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                                     int access);                               // IBVERBS_1.12
using fn_dereg_mr = int (*)(ibv_mr* mr);
using fn_create_comp_channel = ibv_comp_channel* (*)(ibv_context* context);
using fn_destroy_comp_channel = int (*)(ibv_comp_channel* channel);
using fn_create_cq = ibv_cq* (*)(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                                 int comp_vector);
using fn_destroy_cq = int (*)(ibv_cq* cq);
using fn_get_cq_event = int (*)(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context);
using fn_ack_cq_events = void (*)(ibv_cq* cq, unsigned int nevents);
using fn_create_qp = ibv_qp* (*)(ibv_pd* pd, ibv_qp_init_attr* attr);
using fn_modify_qp = int (*)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask);
using fn_destroy_qp = int (*)(ibv_qp* qp);
using fn_wc_status_str = const char* (*)(ibv_wc_status status);

}  // namespace mori::io::rdma::abi
