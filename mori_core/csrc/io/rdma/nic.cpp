#include "io/rdma/nic.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.hpp"
#include "common/logging.hpp"
#include "io/rdma/device_filter.hpp"
#include "io/rdma/gpu_dmabuf.hpp"
#include "io/rdma/pci_topology.hpp"
#include "io/rdma/roce_gid.hpp"

namespace mori::io::rdma {

using namespace abi;

namespace {

constexpr int kMaxRdAtomic = 16;

const char* PortStateName(int s) {
  switch (s) {
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    default: return "NOP";
  }
}

// GID index for a port: MORI_IB_GID_INDEX, else the best RoCE entry from
// sysfs, else (no sysfs in the container) the best entry ibv_query_gid shows.
int SelectGid(const VerbsApi& v, ibv_context* ctx, const std::string& name, int port, int tableLen,
              const RdmaSettings& s, std::array<uint8_t, 16>* gid) {
  ibv_gid g{};
  if (s.gidIndex >= 0) {
    if (v.query_gid(ctx, static_cast<uint8_t>(port), s.gidIndex, &g) != 0)
      throw BadState("MORI_IB_GID_INDEX=" + std::to_string(s.gidIndex) + " cannot be read on " + name + ":" +
                     std::to_string(port) + " (GID table has " + std::to_string(tableLen) + " entries)");
    std::copy(std::begin(g.raw), std::end(g.raw), gid->begin());
    if (IsZeroGid(*gid))
      throw BadState("MORI_IB_GID_INDEX=" + std::to_string(s.gidIndex) + " is an empty GID entry on " + name + ":" +
                     std::to_string(port) + " (see `show_gids` for the valid indices)");
    return s.gidIndex;
  }
  const int scan = std::min(tableLen > 0 ? tableLen : 16, 256);
  std::vector<GidEntry> entries = ReadGidTable(s.sysfsRoot, name, port, scan);
  if (entries.empty()) {
    for (int i = 0; i < scan; ++i) {
      if (v.query_gid(ctx, static_cast<uint8_t>(port), i, &g) != 0) continue;
      GidEntry e;
      e.index = i;
      std::copy(std::begin(g.raw), std::end(g.raw), e.gid.begin());
      if (!IsZeroGid(e.gid)) entries.push_back(e);
    }
  }
  int idx = ChooseGidIndex(entries);
  if (idx < 0)
    throw BadState("no usable GID on " + name + ":" + std::to_string(port) +
                   " (RoCE needs an IP address on the port's netdev; or set MORI_IB_GID_INDEX)");
  if (v.query_gid(ctx, static_cast<uint8_t>(port), idx, &g) != 0)
    throw BadState("ibv_query_gid(" + name + ":" + std::to_string(port) + ", " + std::to_string(idx) + ") failed");
  std::copy(std::begin(g.raw), std::end(g.raw), gid->begin());
  return idx;
}

}  // namespace

NicContext::NicContext(const VerbsApi& v, ibv_context* ctx, std::string n, int p, const ibv_device_attr& dev,
                       const ibv_port_attr& pa, const RdmaSettings& s)
    : verbs(v), context(ctx), name(std::move(n)), port(p) {
  try {
    pd = verbs.alloc_pd(context);
    if (!pd) throw BadState("ibv_alloc_pd on " + name + " failed: " + std::strerror(errno));
    if (s.config.pollCqMode == PollCqMode::EVENT) {
      channel = verbs.create_comp_channel(context);
      if (!channel) throw BadState("ibv_create_comp_channel on " + name + " failed: " + std::strerror(errno));
      int fl = fcntl(channel->fd, F_GETFL);
      if (fl < 0 || fcntl(channel->fd, F_SETFL, fl | O_NONBLOCK) < 0)
        throw BadState("cannot make the completion channel of " + name + " non-blocking");
    }
    linkLayer = pa.link_layer == IBV_LINK_LAYER_UNSPECIFIED ? static_cast<uint8_t>(IBV_LINK_LAYER_INFINIBAND) : pa.link_layer;
    activeMtu = pa.active_mtu;
    lid = pa.lid;
    maxMsgSize = pa.max_msg_sz;
    maxQpWr = dev.max_qp_wr;
    maxCqe = dev.max_cqe;
    maxSge = dev.max_sge;
    maxRdAtomic = std::max(1, std::min(kMaxRdAtomic, dev.max_qp_init_rd_atom));
    maxDestRdAtomic = std::max(1, std::min(kMaxRdAtomic, dev.max_qp_rd_atom));
    if (linkLayer == IBV_LINK_LAYER_ETHERNET || s.gidIndex >= 0)
      gidIndex = SelectGid(verbs, context, name, port, pa.gid_tbl_len, s, &gid);
    else if (lid == 0)
      throw BadState(name + ":" + std::to_string(port) +
                     " is InfiniBand but has no LID (is a subnet manager running? `sminfo`)");
    numaNode = SysfsTopology(s.sysfsRoot).NumaNodeOfIbDevice(name);
  } catch (...) {
    if (channel) verbs.destroy_comp_channel(channel);
    if (pd) verbs.dealloc_pd(pd);
    verbs.close_device(context);
    throw;
  }
}

NicContext::~NicContext() {
  if (channel) verbs.destroy_comp_channel(channel);
  if (pd) verbs.dealloc_pd(pd);
  verbs.close_device(context);
}

PortAddress NicContext::Address() const {
  PortAddress a;
  a.nic = Id();
  a.port = static_cast<uint8_t>(port);
  a.linkLayer = linkLayer;
  a.activeMtu = static_cast<uint8_t>(activeMtu);
  a.maxRdAtomic = static_cast<uint8_t>(maxDestRdAtomic);
  a.lid = lid;
  a.useGrh = gidIndex >= 0 ? 1 : 0;
  a.gid = gid;
  a.maxMsgSize = maxMsgSize;
  return a;
}

std::string NicContext::Describe() const {
  std::string s = name + ":" + std::to_string(port) + " (";
  s += linkLayer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand";
  if (gidIndex >= 0) s += ", GID index " + std::to_string(gidIndex) + " " + FormatGid(gid);
  else s += ", LID " + std::to_string(lid);
  s += ", NUMA " + std::to_string(numaNode) + ")";
  return s;
}

std::vector<NicPtr> OpenNics(const VerbsApi& v, const RdmaSettings& s) {
  DeviceFilter filter = ParseDeviceFilter(s.devices);
  int n = 0;
  errno = 0;
  ibv_device** list = v.get_device_list(&n);
  if (!list) {
    int e = errno;
    throw BadState(std::string("ibv_get_device_list failed: ") + std::strerror(e) +
                   " — this machine exposes no RDMA kernel support (ib_uverbs not loaded, or /dev/infiniband and "
                   "/sys/class/infiniband not visible in this container)");
  }
  struct Free {
    const VerbsApi& v;
    ibv_device** l;
    ~Free() { v.free_device_list(l); }
  } guard{v, list};
  if (n == 0)
    throw BadState("libibverbs found no RDMA device: no RDMA NIC, its kernel driver (mlx5_ib, bnxt_re, irdma, "
                   "ionic, ...) is not loaded, or /dev/infiniband is not passed into the container. A software "
                   "device for testing: `rdma link add rxe0 type rxe netdev <interface>`");

  std::vector<NicPtr> nics;
  std::vector<std::string> names, skipped;
  for (int i = 0; i < n; ++i) {
    const char* cname = v.get_device_name(list[i]);
    std::string name = cname ? cname : "?";
    names.push_back(name);
    ibv_context* ctx = v.open_device(list[i]);
    if (!ctx) {
      skipped.push_back(name + " (cannot open: " + std::strerror(errno) + ")");
      continue;
    }
    ibv_device_attr dev{};
    if (v.query_device(ctx, &dev) != 0) {
      skipped.push_back(name + " (ibv_query_device failed)");
      v.close_device(ctx);
      continue;
    }
    bool ctxUsed = false;
    for (int p = 1; p <= dev.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      std::memset(&pa, 0, sizeof(pa));
      if (v.query_port(ctx, static_cast<uint8_t>(p), &pa) != 0) {
        skipped.push_back(name + ":" + std::to_string(p) + " (ibv_query_port failed)");
        continue;
      }
      std::string where = name + ":" + std::to_string(p);
      if (!filter.Accepts(name, p)) {
        skipped.push_back(where + " (excluded by MORI_RDMA_DEVICES='" + s.devices + "')");
        continue;
      }
      if (pa.state != IBV_PORT_ACTIVE) {
        skipped.push_back(where + " (port " + PortStateName(pa.state) + ")");
        continue;
      }
      // Each port gets its own context so every NicContext owns exactly one.
      ibv_context* portCtx = ctxUsed ? v.open_device(list[i]) : ctx;
      if (!portCtx) {
        skipped.push_back(where + " (cannot open a second context)");
        continue;
      }
      ctxUsed = true;
      try {
        nics.push_back(std::make_shared<NicContext>(v, portCtx, name, p, dev, pa, s));
        MORI_INFO("RDMA: using " << nics.back()->Describe());
      } catch (const std::exception& e) {
        skipped.push_back(where + " (" + e.what() + ")");
      }
    }
    if (!ctxUsed) v.close_device(ctx);
  }
  for (const auto& miss : filter.UnmatchedIncludes(names))
    MORI_WARN("RDMA: MORI_RDMA_DEVICES names '" << miss << "', which is not present");
  if (nics.empty()) {
    std::string msg = "no usable RDMA port among " + std::to_string(n) + " device(s):";
    for (const auto& sk : skipped) msg += " " + sk + ";";
    throw BadState(msg);
  }
  return nics;
}

ibv_mr* RegisterPlain(const NicContext& nic, void* addr, size_t length, int access, bool relaxed, int* err) {
  ibv_mr* mr = nullptr;
  if (relaxed && nic.verbs.reg_mr_iova2) {
    // Relaxed ordering is an "optional" access flag: only the iova2 entry
    // point accepts it, and it is ignored where unsupported.
    mr = nic.verbs.reg_mr_iova2(nic.pd, addr, length, reinterpret_cast<uint64_t>(addr),
                                static_cast<unsigned>(access | IBV_ACCESS_RELAXED_ORDERING));
    if (mr) return mr;
  }
  errno = 0;
  mr = nic.verbs.reg_mr(nic.pd, addr, length, access);
  *err = mr ? 0 : errno;
  return mr;
}

std::shared_ptr<MemoryRegion> MemoryRegion::Register(const NicPtr& nic, const MemoryDesc& d, const RdmaSettings& s,
                                                     std::string* err) {
  // No REMOTE_ATOMIC: the backend never uses atomics and some NICs (ionic,
  // MORI issue #497) refuse MRs that ask for them.
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  auto r = std::shared_ptr<MemoryRegion>(new MemoryRegion());
  r->nic = nic;
  r->addr = d.data;
  r->length = d.size;
  void* ptr = reinterpret_cast<void*>(d.data);
  const std::string what = std::string(ToString(d.loc)) + " memory " + std::to_string(d.id) + " (" +
                           std::to_string(d.size) + " bytes) on " + nic->name;
  if (d.loc == MemoryLocationType::GPU) {
    std::string dmabufWhy = "disabled by MORI_ENABLE_DMABUF_REG=0";
    if (s.dmabuf) {
      if (!nic->verbs.reg_dmabuf_mr) {
        dmabufWhy = "libibverbs has no ibv_reg_dmabuf_mr (rdma-core >= 34 needed)";
      } else {
        GpuDmabuf buf = ExportGpuDmabuf(d.deviceId, d.data, d.size, &dmabufWhy);
        if (buf.fd >= 0) {
          int acc = access | (s.relaxedOrdering ? IBV_ACCESS_RELAXED_ORDERING : 0);
          errno = 0;
          // offset/iova make the MR cover exactly [data, data + size).
          r->mr_ = nic->verbs.reg_dmabuf_mr(nic->pd, buf.offset, d.size, d.data, buf.fd, acc);
          if (!r->mr_ && s.relaxedOrdering) r->mr_ = nic->verbs.reg_dmabuf_mr(nic->pd, buf.offset, d.size, d.data, buf.fd, access);
          int e = errno;
          ::close(buf.fd);
          if (r->mr_) r->viaDmabuf = true;
          else dmabufWhy = std::string("ibv_reg_dmabuf_mr failed: ") + std::strerror(e);
        }
      }
    }
    if (!r->mr_) {
      int e = 0;
      r->mr_ = RegisterPlain(*nic, ptr, d.size, access, s.relaxedOrdering, &e);
      if (!r->mr_) {
        *err = "cannot register " + what + " for RDMA: dma-buf path: " + dmabufWhy + "; ibv_reg_mr: " +
               std::strerror(e) +
               ". GPUDirect RDMA needs either dma-buf (open GPU kernel modules, Linux >= 5.12, rdma-core >= 34) "
               "or the peer-memory module (`modprobe nvidia_peermem`)";
        return nullptr;
      }
    }
  } else {
    int e = 0;
    r->mr_ = RegisterPlain(*nic, ptr, d.size, access, s.relaxedOrdering, &e);
    if (!r->mr_) {
      *err = "cannot register " + what + " for RDMA: ibv_reg_mr: " + std::strerror(e) +
             (e == ENOMEM || e == EPERM || e == EFAULT
                  ? " (the locked-memory limit is too low: `ulimit -l unlimited`, or LimitMEMLOCK=infinity)"
                  : "");
      return nullptr;
    }
  }
  r->lkey = r->mr_->lkey;
  r->rkey = r->mr_->rkey;
  MORI_DEBUG("RDMA: registered " << what << (r->viaDmabuf ? " via dma-buf" : "") << " rkey " << r->rkey);
  return r;
}

void MemoryRegion::Deregister() {
  std::lock_guard<std::mutex> lock(mu_);
  if (mr_) {
    if (nic->verbs.dereg_mr(mr_) != 0) MORI_WARN("RDMA: ibv_dereg_mr on " << nic->name << " failed: " << std::strerror(errno));
    mr_ = nullptr;
  }
}

MemoryRegion::~MemoryRegion() { Deregister(); }

}  // namespace mori::io::rdma
