// A software stand-in for libibverbs, used only by tests: the far side of the
// RDMA backend's verbs interface, so the backend's own code (device setup, QP
// state machine, posting with selective signalling, SQ accounting, completion
// polling, notifications, error and flush handling) runs without a NIC.
//
// Semantics modelled after an RC HCA, executed synchronously inside
// ibv_post_send under one process-wide lock (engines in one process only):
//  * QPs must walk RESET -> INIT -> RTR -> RTS with the attribute masks the
//    verbs spec requires; RoCE (link layer Ethernet) requires a GRH with a
//    valid source GID index and a non-zero destination GID.
//  * Every local SGE must lie in an MR of the QP's PD (lkey), every remote
//    range in an MR of the destination QP's PD with the needed access (rkey).
//  * Send-queue slots are reclaimed only when a signalled completion is
//    polled (like mlx5); posting beyond max_send_wr fails with ENOMEM.
//  * A failing WR completes with an error (signalled or not), moves the QP to
//    ERR; later signalled WRs complete with IBV_WC_WR_FLUSH_ERR. Unsignalled
//    WRs after an error produce no completion (the strictest reading).
//  * SEND consumes a posted receive of the peer QP (none -> RNR retry error).
// Knobs: FAKE_VERBS_DEVICES ("fake0,fake1"; read once per process),
// FAKE_VERBS_LINK_LAYER (eth|ib), FAKE_VERBS_PORT_DOWN (device names),
// FAKE_VERBS_NO_INLINE=1, FAKE_VERBS_FAIL_WRITE_AT=N[@tag] (the N-th RDMA write
// after the value last changed fails with a retry-exceeded error; a new tag
// restarts the count), FAKE_VERBS_DROP_COMPLETIONS=1 (signalled successes are
// withheld until the QP is moved to ERR), FAKE_VERBS_MAX_QP_WR. The others are
// read at each use.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "io/rdma/verbs_abi.hpp"

using namespace mori::io::rdma::abi;

namespace {

std::mutex g_mu;

std::string Env(const char* n, const char* dflt = "") {
  const char* v = std::getenv(n);
  return v ? v : dflt;
}
long EnvInt(const char* n, long dflt) {
  const char* v = std::getenv(n);
  return v && *v ? std::atol(v) : dflt;
}
bool ListHas(const std::string& list, const std::string& name) {
  size_t s = 0;
  while (s <= list.size()) {
    size_t c = list.find(',', s);
    if (list.substr(s, c == std::string::npos ? std::string::npos : c - s) == name) return true;
    if (c == std::string::npos) break;
    s = c + 1;
  }
  return false;
}

struct FakeDevice {
  char name[64];
  int index;
};

struct FakeMr;
struct FakeQp;

struct FakeCq {
  ibv_cq base;
  std::deque<ibv_wc> entries;
  int capacity = 0;
  bool armed = false;
  bool overrun = false;
};

struct FakeChannel {
  ibv_comp_channel base;
  int writeFd = -1;
};

struct FakeMr {
  ibv_mr base;
  unsigned access = 0;
};

struct SentWr {
  uint64_t wrId;
  bool signaled;
  bool completed;  // a completion was generated (success or error)
};

struct FakeQp {
  ibv_qp base;
  uint32_t maxSendWr = 0, maxRecvWr = 0, maxSge = 0, maxInline = 0;
  uint32_t destQpn = 0;
  int port = 0;
  std::deque<SentWr> sq;  // posted, not yet reclaimed by a polled completion
  std::deque<std::pair<uint64_t, ibv_sge>> rq;
  std::vector<ibv_wc> withheld;  // FAKE_VERBS_DROP_COMPLETIONS
};

std::vector<FakeDevice*>& Devices() {
  static std::vector<FakeDevice*> d;
  return d;
}
std::map<uint32_t, FakeQp*> g_qps;
std::map<uint32_t, FakeMr*> g_mrsByKey;
uint32_t g_nextQpn = 0x100;
// What was posted, for tests that check how the backend uses the queue
// (read through fake_verbs_counters() with ctypes).
enum Counter { kPosted, kSignaled, kInline, kFenced, kWrites, kReads, kSends, kPostCalls, kNumCounters };
long g_counters[kNumCounters];
uint32_t g_nextKey = 0x1000;
long g_writes = 0;

bool IsEth() { return Env("FAKE_VERBS_LINK_LAYER", "eth") != "ib"; }

void Push(FakeCq* cq, const ibv_wc& wc) {
  if (static_cast<int>(cq->entries.size()) >= cq->capacity) {
    cq->overrun = true;
    return;
  }
  cq->entries.push_back(wc);
  if (cq->armed && cq->base.channel) {
    cq->armed = false;
    auto* ch = reinterpret_cast<FakeChannel*>(cq->base.channel);
    ibv_cq* p = &cq->base;
    (void)!::write(ch->writeFd, &p, sizeof(p));
  }
}

ibv_wc MakeWc(FakeQp* qp, uint64_t wrId, ibv_wc_status st, ibv_wc_opcode op, uint32_t len) {
  ibv_wc wc{};
  wc.wr_id = wrId;
  wc.status = st;
  wc.opcode = op;
  wc.byte_len = len;
  wc.qp_num = qp->base.qp_num;
  return wc;
}

void FlushRecvs(FakeQp* qp) {
  auto* cq = reinterpret_cast<FakeCq*>(qp->base.recv_cq);
  for (auto& r : qp->rq) Push(cq, MakeWc(qp, r.first, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0));
  qp->rq.clear();
}

void ToError(FakeQp* qp) {
  if (qp->base.state == IBV_QPS_ERR) return;
  qp->base.state = IBV_QPS_ERR;
  auto* cq = reinterpret_cast<FakeCq*>(qp->base.send_cq);
  for (auto& w : qp->withheld) {
    w.status = IBV_WC_WR_FLUSH_ERR;
    Push(cq, w);
  }
  qp->withheld.clear();
  FlushRecvs(qp);
}

FakeMr* FindMr(uint32_t key, ibv_pd* pd) {
  auto it = g_mrsByKey.find(key);
  if (it == g_mrsByKey.end() || it->second->base.pd != pd) return nullptr;
  return it->second;
}

bool InMr(const FakeMr* mr, uint64_t addr, uint64_t len) {
  uint64_t b = reinterpret_cast<uint64_t>(mr->base.addr);
  return addr >= b && len <= mr->base.length && addr - b <= mr->base.length - len;
}

// Executes one WR; returns the completion status.
ibv_wc_status Execute(FakeQp* qp, const ibv_send_wr* wr, uint32_t* bytes) {
  auto it = g_qps.find(qp->destQpn);
  if (it == g_qps.end()) return IBV_WC_RETRY_EXC_ERR;  // nobody answers
  FakeQp* dst = it->second;
  if (dst->base.state != IBV_QPS_RTR && dst->base.state != IBV_QPS_RTS) return IBV_WC_RETRY_EXC_ERR;
  const bool inl = wr->send_flags & IBV_SEND_INLINE;
  uint64_t total = 0;
  for (int i = 0; i < wr->num_sge; ++i) {
    const ibv_sge& s = wr->sg_list[i];
    total += s.length;
    if (inl) continue;
    FakeMr* mr = FindMr(s.lkey, qp->base.pd);
    if (!mr || !InMr(mr, s.addr, s.length)) return IBV_WC_LOC_PROT_ERR;
    if (wr->opcode == IBV_WR_RDMA_READ && !(mr->access & IBV_ACCESS_LOCAL_WRITE)) return IBV_WC_LOC_PROT_ERR;
  }
  if (inl && (wr->opcode != IBV_WR_SEND || total > qp->maxInline)) return IBV_WC_LOC_QP_OP_ERR;
  if (static_cast<uint32_t>(wr->num_sge) > qp->maxSge) return IBV_WC_LOC_QP_OP_ERR;
  *bytes = static_cast<uint32_t>(total);
  if (wr->opcode == IBV_WR_RDMA_WRITE || wr->opcode == IBV_WR_RDMA_READ) {
    const bool isWrite = wr->opcode == IBV_WR_RDMA_WRITE;
    if (isWrite) {
      // Counting restarts whenever the knob changes, so each test sets its own N.
      static std::string lastKnob;
      std::string knob = Env("FAKE_VERBS_FAIL_WRITE_AT");
      if (knob != lastKnob) {
        lastKnob = knob;
        g_writes = 0;
      }
      long at = std::atol(knob.c_str());
      if (at > 0 && ++g_writes == at) return IBV_WC_RETRY_EXC_ERR;
    }
    FakeMr* rmr = FindMr(wr->wr.rdma.rkey, dst->base.pd);
    unsigned need = isWrite ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ;
    if (!rmr || !(rmr->access & need) || !InMr(rmr, wr->wr.rdma.remote_addr, total)) {
      ToError(dst);
      return IBV_WC_REM_ACCESS_ERR;
    }
    auto* remote = reinterpret_cast<uint8_t*>(wr->wr.rdma.remote_addr);
    for (int i = 0; i < wr->num_sge; ++i) {
      const ibv_sge& s = wr->sg_list[i];
      auto* local = reinterpret_cast<uint8_t*>(s.addr);
      if (isWrite) std::memmove(remote, local, s.length);
      else std::memmove(local, remote, s.length);
      remote += s.length;
    }
    return IBV_WC_SUCCESS;
  }
  if (wr->opcode == IBV_WR_SEND) {
    if (dst->rq.empty()) return IBV_WC_RNR_RETRY_EXC_ERR;
    auto r = dst->rq.front();
    dst->rq.pop_front();
    auto* rcq = reinterpret_cast<FakeCq*>(dst->base.recv_cq);
    if (total > r.second.length) {
      Push(rcq, MakeWc(dst, r.first, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, 0));
      ToError(dst);
      return IBV_WC_REM_INV_REQ_ERR;
    }
    auto* out = reinterpret_cast<uint8_t*>(r.second.addr);
    for (int i = 0; i < wr->num_sge; ++i) {
      std::memcpy(out, reinterpret_cast<void*>(wr->sg_list[i].addr), wr->sg_list[i].length);
      out += wr->sg_list[i].length;
    }
    Push(rcq, MakeWc(dst, r.first, IBV_WC_SUCCESS, IBV_WC_RECV, static_cast<uint32_t>(total)));
    return IBV_WC_SUCCESS;
  }
  return IBV_WC_LOC_QP_OP_ERR;
}

ibv_wc_opcode WcOpcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_READ: return IBV_WC_RDMA_READ;
    case IBV_WR_SEND: return IBV_WC_SEND;
    default: return IBV_WC_RDMA_WRITE;
  }
}

int PostSend(ibv_qp* q, ibv_send_wr* wr, ibv_send_wr** bad) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* qp = reinterpret_cast<FakeQp*>(q);
  auto* cq = reinterpret_cast<FakeCq*>(qp->base.send_cq);
  if (qp->base.state != IBV_QPS_RTS && qp->base.state != IBV_QPS_ERR) {
    *bad = wr;
    return EINVAL;
  }
  ++g_counters[kPostCalls];
  for (; wr; wr = wr->next) {
    if (qp->sq.size() >= qp->maxSendWr) {
      *bad = wr;
      return ENOMEM;
    }
    const bool signaled = wr->send_flags & IBV_SEND_SIGNALED;
    qp->sq.push_back({wr->wr_id, signaled, false});
    ++g_counters[kPosted];
    g_counters[kSignaled] += signaled;
    g_counters[kInline] += (wr->send_flags & IBV_SEND_INLINE) != 0;
    g_counters[kFenced] += (wr->send_flags & IBV_SEND_FENCE) != 0;
    g_counters[kWrites] += wr->opcode == IBV_WR_RDMA_WRITE;
    g_counters[kReads] += wr->opcode == IBV_WR_RDMA_READ;
    g_counters[kSends] += wr->opcode == IBV_WR_SEND;
    if (qp->base.state == IBV_QPS_ERR) {
      if (signaled) {
        Push(cq, MakeWc(qp, wr->wr_id, IBV_WC_WR_FLUSH_ERR, WcOpcode(wr->opcode), 0));
        qp->sq.back().completed = true;
      }
      continue;
    }
    uint32_t bytes = 0;
    ibv_wc_status st = Execute(qp, wr, &bytes);
    if (st != IBV_WC_SUCCESS) {
      Push(cq, MakeWc(qp, wr->wr_id, st, WcOpcode(wr->opcode), 0));
      qp->sq.back().completed = true;
      ToError(qp);
      continue;
    }
    if (signaled) {
      ibv_wc wc = MakeWc(qp, wr->wr_id, IBV_WC_SUCCESS, WcOpcode(wr->opcode), bytes);
      if (Env("FAKE_VERBS_DROP_COMPLETIONS") == "1") qp->withheld.push_back(wc);
      else Push(cq, wc);
      qp->sq.back().completed = true;
    }
  }
  return 0;
}

int PostRecv(ibv_qp* q, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* qp = reinterpret_cast<FakeQp*>(q);
  if (qp->base.state == IBV_QPS_RESET) {
    *bad = wr;
    return EINVAL;
  }
  for (; wr; wr = wr->next) {
    if (qp->rq.size() >= qp->maxRecvWr || wr->num_sge != 1) {
      *bad = wr;
      return ENOMEM;
    }
    FakeMr* mr = FindMr(wr->sg_list[0].lkey, qp->base.pd);
    if (!mr || !InMr(mr, wr->sg_list[0].addr, wr->sg_list[0].length)) {
      *bad = wr;
      return EINVAL;
    }
    qp->rq.push_back({wr->wr_id, wr->sg_list[0]});
    if (qp->base.state == IBV_QPS_ERR) FlushRecvs(qp);
  }
  return 0;
}

int PollCq(ibv_cq* c, int n, ibv_wc* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* cq = reinterpret_cast<FakeCq*>(c);
  if (cq->overrun) return -1;
  int k = 0;
  while (k < n && !cq->entries.empty()) {
    out[k] = cq->entries.front();
    cq->entries.pop_front();
    if (!(out[k].opcode & IBV_WC_RECV)) {
      // A polled send completion reclaims its slot and every slot before it.
      auto it = g_qps.find(out[k].qp_num);
      if (it != g_qps.end()) {
        auto& sq = it->second->sq;
        while (!sq.empty()) {
          bool match = sq.front().completed && sq.front().wrId == out[k].wr_id;
          sq.pop_front();
          if (match) break;
        }
      }
    }
    ++k;
  }
  return k;
}

int ReqNotify(ibv_cq* c, int) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* cq = reinterpret_cast<FakeCq*>(c);
  cq->armed = true;
  if (!cq->entries.empty() && cq->base.channel) {
    cq->armed = false;
    auto* ch = reinterpret_cast<FakeChannel*>(cq->base.channel);
    ibv_cq* p = c;
    (void)!::write(ch->writeFd, &p, sizeof(p));
  }
  return 0;
}

}  // namespace

extern "C" {

ibv_device** ibv_get_device_list(int* n) {
  std::lock_guard<std::mutex> lock(g_mu);
  static std::vector<ibv_device*> list;
  auto& devs = Devices();
  if (devs.empty()) {
    std::string names = Env("FAKE_VERBS_DEVICES", "fake0");
    size_t s = 0;
    while (s < names.size()) {
      size_t c = names.find(',', s);
      std::string nm = names.substr(s, c == std::string::npos ? std::string::npos : c - s);
      auto* d = new FakeDevice{};
      std::snprintf(d->name, sizeof(d->name), "%s", nm.c_str());
      d->index = static_cast<int>(devs.size());
      devs.push_back(d);
      if (c == std::string::npos) break;
      s = c + 1;
    }
  }
  list.clear();
  for (auto* d : devs) list.push_back(reinterpret_cast<ibv_device*>(d));
  list.push_back(nullptr);
  *n = static_cast<int>(devs.size());
  return list.data();
}

void ibv_free_device_list(ibv_device**) {}

const char* ibv_get_device_name(ibv_device* d) { return reinterpret_cast<FakeDevice*>(d)->name; }

ibv_context* ibv_open_device(ibv_device* d) {
  auto* ctx = new ibv_context{};
  ctx->device = d;
  ctx->ops.post_send = PostSend;
  ctx->ops.post_recv = PostRecv;
  ctx->ops.poll_cq = PollCq;
  ctx->ops.req_notify_cq = ReqNotify;
  ctx->num_comp_vectors = 1;
  return ctx;
}

int ibv_close_device(ibv_context* ctx) {
  delete ctx;
  return 0;
}

int ibv_query_device(ibv_context*, ibv_device_attr* a) {
  std::memset(a, 0, sizeof(*a));
  std::snprintf(a->fw_ver, sizeof(a->fw_ver), "fake");
  a->max_qp = 1 << 16;
  a->max_qp_wr = static_cast<int>(EnvInt("FAKE_VERBS_MAX_QP_WR", 4096));
  a->max_sge = 8;
  a->max_cq = 1 << 16;
  a->max_cqe = 1 << 20;
  a->max_mr = 1 << 20;
  a->max_pd = 1 << 10;
  a->max_qp_rd_atom = 16;
  a->max_qp_init_rd_atom = 16;
  a->phys_port_cnt = 1;
  return 0;
}

int ibv_query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* a) {
  if (port != 1) return EINVAL;
  auto* d = reinterpret_cast<FakeDevice*>(ctx->device);
  a->state = ListHas(Env("FAKE_VERBS_PORT_DOWN"), d->name) ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
  a->max_mtu = IBV_MTU_4096;
  a->active_mtu = IBV_MTU_4096;
  a->gid_tbl_len = 4;
  a->max_msg_sz = 1u << 31;
  a->lid = IsEth() ? 0 : static_cast<uint16_t>(1 + d->index);
  a->link_layer = IsEth() ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
  return 0;
}

int ibv_query_gid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) {
  std::memset(gid, 0, sizeof(*gid));
  if (port != 1 || index < 0 || index >= 4) return EINVAL;
  if (index == 1) {  // an IPv4-mapped entry (::ffff:127.0.0.N); 0 stays link-local, 2-3 empty
    gid->raw[10] = gid->raw[11] = 0xff;
    gid->raw[12] = 127;
    gid->raw[15] = static_cast<uint8_t>(1 + reinterpret_cast<FakeDevice*>(ctx->device)->index);
  } else if (index == 0) {
    gid->raw[0] = 0xfe;
    gid->raw[1] = 0x80;
    gid->raw[15] = 1;
  }
  return 0;
}

ibv_pd* ibv_alloc_pd(ibv_context* ctx) {
  auto* pd = new ibv_pd{};
  pd->context = ctx;
  return pd;
}

int ibv_dealloc_pd(ibv_pd* pd) {
  delete pd;
  return 0;
}

ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t len, int access) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (access & ~(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* mr = new FakeMr{};
  mr->base.context = pd->context;
  mr->base.pd = pd;
  mr->base.addr = addr;
  mr->base.length = len;
  mr->base.lkey = mr->base.rkey = g_nextKey++;
  mr->access = static_cast<unsigned>(access);
  g_mrsByKey[mr->base.lkey] = mr;
  return &mr->base;
}

int ibv_dereg_mr(ibv_mr* m) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_mrsByKey.erase(m->lkey);
  delete reinterpret_cast<FakeMr*>(m);
  return 0;
}

ibv_comp_channel* ibv_create_comp_channel(ibv_context* ctx) {
  int fds[2];
  if (::pipe(fds) != 0) return nullptr;
  fcntl(fds[1], F_SETFL, O_NONBLOCK);
  auto* ch = new FakeChannel{};
  ch->base.context = ctx;
  ch->base.fd = fds[0];
  ch->writeFd = fds[1];
  return &ch->base;
}

int ibv_destroy_comp_channel(ibv_comp_channel* c) {
  auto* ch = reinterpret_cast<FakeChannel*>(c);
  ::close(ch->base.fd);
  ::close(ch->writeFd);
  delete ch;
  return 0;
}

int ibv_get_cq_event(ibv_comp_channel* c, ibv_cq** cq, void** ctx) {
  ibv_cq* p = nullptr;
  if (::read(c->fd, &p, sizeof(p)) != sizeof(p)) return -1;
  *cq = p;
  *ctx = p->cq_context;
  return 0;
}

void ibv_ack_cq_events(ibv_cq*, unsigned) {}

ibv_cq* ibv_create_cq(ibv_context* ctx, int cqe, void* cqCtx, ibv_comp_channel* ch, int) {
  if (cqe < 1 || cqe > (1 << 20)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* cq = new FakeCq{};
  cq->base.context = ctx;
  cq->base.channel = ch;
  cq->base.cq_context = cqCtx;
  cq->base.cqe = cqe;
  cq->capacity = cqe;
  return &cq->base;
}

int ibv_destroy_cq(ibv_cq* c) {
  std::lock_guard<std::mutex> lock(g_mu);
  delete reinterpret_cast<FakeCq*>(c);
  return 0;
}

ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* a) {
  std::lock_guard<std::mutex> lock(g_mu);
  long maxWr = EnvInt("FAKE_VERBS_MAX_QP_WR", 4096);
  if (a->qp_type != IBV_QPT_RC || a->cap.max_send_wr > static_cast<uint32_t>(maxWr) || a->cap.max_send_sge > 8 ||
      a->cap.max_recv_wr > static_cast<uint32_t>(maxWr) || !a->send_cq || !a->recv_cq ||
      (Env("FAKE_VERBS_NO_INLINE") == "1" && a->cap.max_inline_data > 0) || a->cap.max_inline_data > 256) {
    errno = EINVAL;
    return nullptr;
  }
  auto* qp = new FakeQp{};
  qp->base.context = pd->context;
  qp->base.qp_context = a->qp_context;
  qp->base.pd = pd;
  qp->base.send_cq = a->send_cq;
  qp->base.recv_cq = a->recv_cq;
  qp->base.qp_num = g_nextQpn++;
  qp->base.state = IBV_QPS_RESET;
  qp->base.qp_type = IBV_QPT_RC;
  qp->maxSendWr = a->cap.max_send_wr;
  qp->maxRecvWr = a->cap.max_recv_wr;
  qp->maxSge = a->cap.max_send_sge;
  qp->maxInline = a->cap.max_inline_data;
  g_qps[qp->base.qp_num] = qp;
  return &qp->base;
}

int ibv_modify_qp(ibv_qp* q, ibv_qp_attr* a, int mask) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* qp = reinterpret_cast<FakeQp*>(q);
  if (!(mask & IBV_QP_STATE)) return EINVAL;
  auto need = [&](int m) { return (mask & m) == m; };
  switch (a->qp_state) {
    case IBV_QPS_INIT:
      if (qp->base.state != IBV_QPS_RESET ||
          !need(IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) || a->port_num != 1)
        return EINVAL;
      qp->port = a->port_num;
      break;
    case IBV_QPS_RTR:
      if (qp->base.state != IBV_QPS_INIT ||
          !need(IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) ||
          a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096 || a->ah_attr.port_num != 1)
        return EINVAL;
      if (IsEth()) {
        bool zero = true;
        for (uint8_t b : a->ah_attr.grh.dgid.raw) zero = zero && b == 0;
        if (!a->ah_attr.is_global || zero || a->ah_attr.grh.sgid_index != 1) return EINVAL;
      } else if (a->ah_attr.dlid == 0) {
        return EINVAL;
      }
      qp->destQpn = a->dest_qp_num;
      break;
    case IBV_QPS_RTS:
      if (qp->base.state != IBV_QPS_RTR ||
          !need(IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                IBV_QP_MAX_QP_RD_ATOMIC) ||
          a->rnr_retry > 7 || a->retry_cnt > 7 || a->max_rd_atomic > 16)
        return EINVAL;
      break;
    case IBV_QPS_ERR:
      ToError(qp);
      return 0;
    default:
      return EINVAL;
  }
  qp->base.state = a->qp_state;
  return 0;
}

int ibv_destroy_qp(ibv_qp* q) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_qps.erase(q->qp_num);
  delete reinterpret_cast<FakeQp*>(q);
  return 0;
}

const char* ibv_wc_status_str(ibv_wc_status s) { return s == IBV_WC_SUCCESS ? "success" : "error"; }

// Test introspection: posted, signalled, inline, fenced WRs, RDMA writes,
// reads, sends and ibv_post_send calls since the last reset.
void fake_verbs_counters(long* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < kNumCounters; ++i) out[i] = g_counters[i];
}

void fake_verbs_reset_counters() {
  std::lock_guard<std::mutex> lock(g_mu);
  for (long& c : g_counters) c = 0;
}

}  // extern "C"
