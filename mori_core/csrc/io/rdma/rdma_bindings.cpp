// mori_core._C._rdma_testing: the RDMA backend's pure logic, callable from
// Python so the parts that need no NIC are tested in CI (device filter,
// sysfs topology and GID choice on a fake tree, the post planner, the
// control-protocol codec, SQ admission, settings and error texts).
// Internal: not part of the public API.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <array>
#include <chrono>

#include "common/error.hpp"
#include "io/rdma/completion_errors.hpp"
#include "io/rdma/control_protocol.hpp"
#include "io/rdma/device_filter.hpp"
#include "io/rdma/gpu_dmabuf.hpp"
#include "io/rdma/pci_topology.hpp"
#include "io/rdma/post_planner.hpp"
#include "io/rdma/rdma_settings.hpp"
#include "io/rdma/roce_gid.hpp"
#include "io/rdma/sq_credits.hpp"
#include "io/rdma/verbs_api.hpp"

namespace py = pybind11;
using namespace mori::io;
using namespace mori::io::rdma;

namespace mori::bindings {
namespace {

py::bytes ToBytes(const std::vector<uint8_t>& v) { return py::bytes(reinterpret_cast<const char*>(v.data()), v.size()); }

std::vector<uint8_t> FromBytes(const py::bytes& b) {
  std::string s = b;
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::array<uint8_t, 16> GidFrom(const std::string& text) {
  std::array<uint8_t, 16> g{};
  if (!ParseGid(text, &g)) throw InvalidArgument("not a GID: '" + text + "'");
  return g;
}

py::dict PortToDict(const PortAddress& p) {
  py::dict d;
  d["nic"] = p.nic;
  d["port"] = p.port;
  d["link_layer"] = p.linkLayer;
  d["active_mtu"] = p.activeMtu;
  d["max_rd_atomic"] = p.maxRdAtomic;
  d["lid"] = p.lid;
  d["use_grh"] = p.useGrh;
  d["gid"] = FormatGid(p.gid);
  d["max_msg_size"] = p.maxMsgSize;
  return d;
}

PortAddress PortFromDict(const py::dict& d) {
  PortAddress p;
  p.nic = d["nic"].cast<std::string>();
  p.port = d["port"].cast<uint8_t>();
  p.linkLayer = d["link_layer"].cast<uint8_t>();
  p.activeMtu = d["active_mtu"].cast<uint8_t>();
  p.maxRdAtomic = d["max_rd_atomic"].cast<uint8_t>();
  p.lid = d["lid"].cast<uint16_t>();
  p.useGrh = d["use_grh"].cast<uint8_t>();
  p.gid = GidFrom(d["gid"].cast<std::string>());
  p.maxMsgSize = d["max_msg_size"].cast<uint32_t>();
  return p;
}

std::vector<QpAddress> QpsFrom(const py::list& l) {
  std::vector<QpAddress> out;
  for (auto item : l) {
    auto t = item.cast<std::pair<uint32_t, uint32_t>>();
    out.push_back({t.first, t.second});
  }
  return out;
}

py::list QpsTo(const std::vector<QpAddress>& qps) {
  py::list l;
  for (const auto& q : qps) l.append(py::make_tuple(q.qpn, q.psn));
  return l;
}

const char* GidTypeName(GidType t) {
  switch (t) {
    case GidType::RoceV1: return "RoCE v1";
    case GidType::RoceV2: return "RoCE v2";
    default: return "";
  }
}

py::bytes EncodeControl(const std::string& kind, const py::dict& f) {
  if (kind == "hello") return ToBytes(Encode(HelloRequest{}));
  if (kind == "hello_reply") {
    HelloReply m;
    m.linkLayerMask = f["link_layer_mask"].cast<uint8_t>();
    m.numNics = f["num_nics"].cast<uint16_t>();
    return ToBytes(Encode(m));
  }
  if (kind == "get_memory") return ToBytes(Encode(GetMemoryRequest{f["mem_id"].cast<uint32_t>()}));
  if (kind == "memory_info") {
    MemoryInfoReply m;
    m.code = static_cast<StatusCode>(f["code"].cast<uint32_t>());
    m.message = f["message"].cast<std::string>();
    m.nic = f["nic"].cast<std::string>();
    m.addr = f["addr"].cast<uint64_t>();
    m.size = f["size"].cast<uint64_t>();
    m.rkey = f["rkey"].cast<uint32_t>();
    return ToBytes(Encode(m));
  }
  if (kind == "connect") {
    ConnectRequest m;
    m.groupId = f["group_id"].cast<uint64_t>();
    m.targetNic = f["target_nic"].cast<std::string>();
    m.initiator = PortFromDict(f["initiator"].cast<py::dict>());
    m.qps = QpsFrom(f["qps"].cast<py::list>());
    return ToBytes(Encode(m));
  }
  if (kind == "connected") {
    ConnectedReply m;
    m.code = static_cast<StatusCode>(f["code"].cast<uint32_t>());
    m.message = f["message"].cast<std::string>();
    if (m.code == StatusCode::SUCCESS) {
      m.target = PortFromDict(f["target"].cast<py::dict>());
      m.qps = QpsFrom(f["qps"].cast<py::list>());
    }
    return ToBytes(Encode(m));
  }
  if (kind == "release") {
    ReleaseRequest m;
    m.groupIds = f["group_ids"].cast<std::vector<uint64_t>>();
    return ToBytes(Encode(m));
  }
  if (kind == "released") return ToBytes(Encode(ReleasedReply{}));
  throw InvalidArgument("encode_control: unknown kind '" + kind + "'");
}

py::dict DecodeControl(const py::bytes& b) {
  std::vector<uint8_t> body = FromBytes(b);
  py::dict d;
  switch (PeekType(body)) {
    case MsgType::Hello:
      d["kind"] = "hello";
      break;
    case MsgType::HelloReply: {
      auto m = DecodeHelloReply(body);
      d["kind"] = "hello_reply";
      d["link_layer_mask"] = m.linkLayerMask;
      d["num_nics"] = m.numNics;
      break;
    }
    case MsgType::GetMemory:
      d["kind"] = "get_memory";
      d["mem_id"] = DecodeGetMemory(body).memId;
      break;
    case MsgType::MemoryInfo: {
      auto m = DecodeMemoryInfo(body);
      d["kind"] = "memory_info";
      d["code"] = static_cast<uint32_t>(m.code);
      d["message"] = m.message;
      d["nic"] = m.nic;
      d["addr"] = m.addr;
      d["size"] = m.size;
      d["rkey"] = m.rkey;
      break;
    }
    case MsgType::Connect: {
      auto m = DecodeConnect(body);
      d["kind"] = "connect";
      d["group_id"] = m.groupId;
      d["target_nic"] = m.targetNic;
      d["initiator"] = PortToDict(m.initiator);
      d["qps"] = QpsTo(m.qps);
      break;
    }
    case MsgType::Connected: {
      auto m = DecodeConnected(body);
      d["kind"] = "connected";
      d["code"] = static_cast<uint32_t>(m.code);
      d["message"] = m.message;
      if (m.code == StatusCode::SUCCESS) {
        d["target"] = PortToDict(m.target);
        d["qps"] = QpsTo(m.qps);
      }
      break;
    }
    case MsgType::Release:
      d["kind"] = "release";
      d["group_ids"] = DecodeRelease(body).groupIds;
      break;
    case MsgType::Released:
      DecodeReleased(body);
      d["kind"] = "released";
      break;
  }
  return d;
}

}  // namespace

void RegisterRdmaTesting(py::module_& parent) {
  py::module_ m = parent.def_submodule("_rdma_testing", "Internal: RDMA backend logic exposed for tests");

  m.def(
      "parse_device_filter",
      [](const std::string& spec) {
        DeviceFilter f = ParseDeviceFilter(spec);
        py::list entries;
        for (const auto& e : f.entries) entries.append(py::make_tuple(e.name, e.port));
        py::dict d;
        d["exclude"] = f.exclude;
        d["entries"] = entries;
        return d;
      },
      py::arg("spec"));
  m.def(
      "device_filter_accepts",
      [](const std::string& spec, const std::string& name, int port) { return ParseDeviceFilter(spec).Accepts(name, port); },
      py::arg("spec"), py::arg("name"), py::arg("port"));
  m.def(
      "device_filter_unmatched",
      [](const std::string& spec, const std::vector<std::string>& present) {
        return ParseDeviceFilter(spec).UnmatchedIncludes(present);
      },
      py::arg("spec"), py::arg("present"));

  m.def("normalize_bus_id", &NormalizeBusId, py::arg("bus_id"));
  m.def(
      "rank_nics",
      [](const std::string& root, const std::string& gpuBusId, const std::vector<std::string>& nics) {
        py::list out;
        for (const auto& d : SysfsTopology(root).Rank(gpuBusId, nics)) {
          py::dict e;
          e["nic"] = d.nic;
          e["path"] = ToString(d.path);
          e["hops"] = d.hops;
          e["numa"] = d.numaNode;
          out.append(e);
        }
        return out;
      },
      py::arg("sysfs_root"), py::arg("gpu_bus_id"), py::arg("nics"));
  m.def(
      "pick_nic_for_gpu",
      [](const std::string& root, const std::string& gpuBusId, const std::vector<std::string>& nics, int spread) {
        auto ranked = SysfsTopology(root).Rank(gpuBusId, nics);
        return ranked.empty() ? std::string() : ranked[PickClosest(ranked, spread)].nic;
      },
      py::arg("sysfs_root"), py::arg("gpu_bus_id"), py::arg("nics"), py::arg("spread"));
  m.def("pick_nic_for_host_memory", &PickForHostMemory, py::arg("nic_numa_nodes"), py::arg("mem_numa_node"),
        py::arg("counter"));

  m.def(
      "read_gid_table",
      [](const std::string& root, const std::string& dev, int port, int maxEntries) {
        py::list out;
        for (const auto& e : ReadGidTable(root, dev, port, maxEntries))
          out.append(py::make_tuple(e.index, FormatGid(e.gid), GidTypeName(e.type)));
        return out;
      },
      py::arg("sysfs_root"), py::arg("device"), py::arg("port"), py::arg("max_entries") = 256);
  m.def(
      "choose_gid_index",
      [](const std::vector<std::tuple<int, std::string, std::string>>& entries) {
        std::vector<GidEntry> es;
        for (const auto& [idx, gid, type] : entries) {
          GidEntry e;
          e.index = idx;
          e.gid = GidFrom(gid);
          e.type = type == "RoCE v2" ? GidType::RoceV2 : type == "RoCE v1" ? GidType::RoceV1 : GidType::Unknown;
          es.push_back(e);
        }
        return ChooseGidIndex(es);
      },
      py::arg("entries"), "entries: (index, 'xxxx:...:xxxx', 'RoCE v1' | 'RoCE v2' | '')");

  m.def(
      "plan_posts",
      [](const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& segments, uint64_t uid, int numQps,
         int postBatchSize, uint32_t sqDepth, int maxSge, uint64_t maxMsgBytes, bool chunking, uint64_t chunkBytes,
         int maxChunks, bool notify) {
        SegmentList segs;
        for (const auto& [lo, ro, sz] : segments) segs.push_back({lo, ro, sz});
        PlanLimits l;
        l.numQps = numQps;
        l.postBatchSize = postBatchSize;
        l.sqDepth = sqDepth;
        l.maxSge = maxSge;
        l.maxMsgBytes = maxMsgBytes;
        l.chunking = chunking;
        l.chunkBytes = chunkBytes;
        l.maxChunks = maxChunks;
        l.notify = notify;
        PostPlan p = PlanPosts(segs, uid, l);
        py::list sges, wrs, chains;
        for (const auto& s : p.sges) sges.append(py::make_tuple(s.localOffset, s.length));
        for (const auto& w : p.wrs) wrs.append(py::make_tuple(w.remoteOffset, w.length, w.firstSge, w.numSge));
        for (const auto& c : p.chains) chains.append(py::make_tuple(c.qp, c.firstWr, c.numWrs));
        py::dict d;
        d["sges"] = sges;
        d["wrs"] = wrs;
        d["chains"] = chains;
        d["qps_used"] = p.qpsUsed;
        d["wr_byte_limit"] = p.wrByteLimit;
        d["batch_size"] = p.batchSize;
        return d;
      },
      py::arg("segments"), py::arg("uid") = 0, py::arg("num_qps") = 1, py::arg("post_batch_size") = -1,
      py::arg("sq_depth") = 8192, py::arg("max_sge") = 4, py::arg("max_msg_bytes") = 1ull << 31,
      py::arg("chunking") = false, py::arg("chunk_bytes") = 65536, py::arg("max_chunks") = 64,
      py::arg("notify") = true, "segments: (local_offset, remote_offset, size)");

  m.def("describe_completion_error", &DescribeCompletionError, py::arg("status"), py::arg("vendor_err") = 0,
        py::arg("is_read") = false, py::arg("is_notification") = false);
  m.def("describe_send_queue_full", &DescribeSendQueueFull, py::arg("sq_depth"), py::arg("needed"),
        py::arg("waited_us"));

  m.def(
      "resolve_settings",
      [](const RdmaBackendConfig& c) {
        RdmaSettings s = ResolveSettings(c);
        py::dict d;
        d["qp_per_transfer"] = s.config.qpPerTransfer;
        d["post_batch_size"] = s.config.postBatchSize;
        d["num_worker_threads"] = s.config.numWorkerThreads;
        d["worker_threads"] = s.workerThreads();
        d["poll_cq_mode"] = static_cast<int>(s.config.pollCqMode);
        d["enable_notification"] = s.config.enableNotification;
        d["notif_per_qp"] = s.config.notifPerQp;
        d["enable_transfer_chunking"] = s.config.enableTransferChunking;
        d["chunk_bytes"] = s.config.chunkBytes;
        d["max_chunks_per_transfer"] = s.config.maxChunksPerTransfer;
        d["max_send_wr"] = s.maxSendWr();
        d["max_cqe"] = s.maxCqe();
        d["max_sge"] = s.maxSge();
        d["devices"] = s.devices;
        d["gid_index"] = s.gidIndex;
        d["path_mtu"] = s.pathMtu;
        d["service_level"] = s.serviceLevel;
        d["traffic_class"] = s.trafficClass;
        d["qp_timeout"] = s.qpTimeout;
        d["retry_count"] = s.retryCount;
        d["rnr_retry"] = s.rnrRetry;
        d["relaxed_ordering"] = s.relaxedOrdering;
        d["dmabuf"] = s.dmabuf;
        d["sq_backoff_timeout_us"] = s.sqBackoffTimeoutUs;
        d["control_timeout_ms"] = s.controlTimeoutMs;
        d["stall_timeout_ms"] = s.stallTimeoutMs;
        d["sysfs_root"] = s.sysfsRoot;
        return d;
      },
      py::arg("config"));

  m.def("verbs_status", [] {
    py::dict d;
    const VerbsApi* v = Verbs();
    d["loaded"] = v != nullptr;
    d["error"] = VerbsLoadError();
    d["library"] = v ? v->libraryPath : std::string();
    d["dmabuf"] = v && v->reg_dmabuf_mr != nullptr;
    return d;
  });

  m.def(
      "export_gpu_dmabuf",
      [](int device, uint64_t ptr, uint64_t size) {
        std::string why;
        GpuDmabuf b = ExportGpuDmabuf(device, ptr, size, &why);
        py::dict d;
        d["ok"] = b.fd >= 0;
        d["error"] = why;
        d["offset"] = b.offset;
        // A dma-buf's size is what lseek(SEEK_END) reports.
        d["dmabuf_size"] = b.fd >= 0 ? static_cast<int64_t>(::lseek(b.fd, 0, SEEK_END)) : -1;
        if (b.fd >= 0) ::close(b.fd);
        return d;
      },
      py::arg("device"), py::arg("ptr"), py::arg("size"), py::call_guard<py::gil_scoped_release>(),
      "The dma-buf export the RDMA backend uses for GPU memory (the fd is closed again).");

  m.def("encode_control", &EncodeControl, py::arg("kind"), py::arg("fields") = py::dict());
  m.def("decode_control", &DecodeControl, py::arg("body"));
  m.attr("MAX_CONTROL_BYTES") = kMaxControlBytes;

  py::class_<SqCredits>(m, "SqCredits")
      .def(py::init<uint32_t>(), py::arg("depth"))
      .def(
          "acquire",
          [](SqCredits& c, uint32_t n, int64_t timeoutUs) {
            switch (c.Acquire(n, timeoutUs)) {
              case SqCredits::Result::Ok: return "ok";
              case SqCredits::Result::TimedOut: return "timed_out";
              case SqCredits::Result::Aborted: return "aborted";
              default: return "too_large";
            }
          },
          py::arg("n"), py::arg("timeout_us"), py::call_guard<py::gil_scoped_release>())
      .def("release", &SqCredits::Release, py::arg("n"))
      .def("abort", &SqCredits::Abort)
      .def("available", &SqCredits::Available)
      .def_property_readonly("depth", &SqCredits::depth);
}

}  // namespace mori::bindings
