// Bindings of MORI-IO. Names, argument order and defaults follow AMD's
// `mori.cpp` module; TcpBackendConfig and the auth fields are our additions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.hpp"
#include "bindings/io_offsets.hpp"
#include "common/error.hpp"
#include "io/engine.hpp"
#include "io/segments.hpp"
#include "io/submit_profile.hpp"

namespace py = pybind11;
using namespace mori::io;

namespace mori::bindings {
namespace {

py::bytes ToBytes(const std::vector<uint8_t>& v) { return py::bytes(reinterpret_cast<const char*>(v.data()), v.size()); }

template <typename Desc>
Desc FromBytes(const py::bytes& b) {
  std::string s = b;
  return Desc::Unpack(s.data(), s.size());
}

using Offsets = std::vector<uint64_t>;

// Single transfers: four integers, converted by pybind11 before the body runs.
template <typename Fn>
StatusPtr Single(Fn&& submit) {
  profile::Begin();
  profile::Mark(profile::kConverted);
  py::gil_scoped_release nogil;
  return submit();
}

// Session batch: the three lists are read without a Python object per element
// (scratch buffers reused per thread), then the GIL is released for the submit.
StatusPtr SessionBatch(IOEngineSession& s, py::handle lo, py::handle ro, py::handle sz, TransferUniqueId uid,
                       bool isRead) {
  profile::Begin();
  static thread_local Offsets l, r, z;
  ReadOffsets(lo, "local_offsets", &l);
  ReadOffsets(ro, "remote_offsets", &r);
  ReadOffsets(sz, "sizes", &z);
  profile::Mark(profile::kConverted);
  py::gil_scoped_release nogil;
  return s.BatchReadWrite(l, r, z, uid, isRead);
}

size_t Length(py::handle h, const char* name) {
  Py_ssize_t n = PyObject_Length(h.ptr());
  if (n < 0) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + " must be a list (one entry per memory pair), got " +
                         Py_TYPE(h.ptr())->tp_name);
  }
  return static_cast<size_t>(n);
}

// The items of an outer argument list, borrowed from one PySequence_Fast (a list or
// tuple is used as is): no new reference per item.
class FastItems {
 public:
  FastItems(py::handle seq, const char* name) : seq_(PySequence_Fast(seq.ptr(), "")) {
    if (!seq_) {
      PyErr_Clear();
      throw py::type_error(std::string(name) + " must be a list (one entry per memory pair), got " +
                           Py_TYPE(seq.ptr())->tp_name);
    }
  }
  ~FastItems() { Py_DECREF(seq_); }
  FastItems(const FastItems&) = delete;
  FastItems& operator=(const FastItems&) = delete;
  size_t size() const { return static_cast<size_t>(PySequence_Fast_GET_SIZE(seq_)); }
  PyObject* operator[](size_t i) const { return PySequence_Fast_ITEMS(seq_)[i]; }

 private:
  PyObject* seq_;
};

// Engine batch: every argument is read and checked before anything is submitted.
std::vector<StatusPtr> EngineBatch(IOEngine& e, py::handle lm, py::handle lo, py::handle rm, py::handle ro,
                                   py::handle sz, py::handle uids, bool isRead, const char* localName,
                                   const char* remoteName) {
  profile::Begin();
  const FastItems lms(lm, localName), los(lo, "local_offsets"), rms(rm, remoteName), ros(ro, "remote_offsets"),
      szs(sz, "sizes");
  const size_t n = lms.size();
  if (los.size() != n || rms.size() != n || ros.size() != n || szs.size() != n || Length(uids, "transfer_uids") != n)
    throw mori::InvalidArgument("batch transfer: local_mems, local_offsets, remote_mems, remote_offsets, sizes and "
                          "transfer_uids must have the same length (one entry per memory pair)");
  std::vector<py::object> keep;  // the descriptors stay alive while the GIL is released
  keep.reserve(2 * n);
  std::vector<const MemoryDesc*> locals(n), remotes(n);
  // One type check and conversion per descriptor (isinstance and then cast looked the type up twice).
  auto desc = [&](const FastItems& seq, size_t i, const char* name) -> const MemoryDesc* {
    PyObject* item = seq[i];
    py::detail::make_caster<MemoryDesc> caster;
    if (!caster.load(item, /*convert=*/false))
      throw py::type_error(std::string(name) + "[" + std::to_string(i) + "] must be a MemoryDesc, got " +
                           Py_TYPE(item)->tp_name);
    const MemoryDesc* d = &py::detail::cast_op<const MemoryDesc&>(caster);
    keep.push_back(py::reinterpret_borrow<py::object>(item));
    return d;
  };
  static thread_local std::vector<Offsets> l, r, z;
  l.resize(n);
  r.resize(n);
  z.resize(n);
  std::vector<TransferUniqueId> ids;
  ReadOffsets(uids, "transfer_uids", &ids);
  for (size_t i = 0; i < n; ++i) {
    locals[i] = desc(lms, i, localName);
    remotes[i] = desc(rms, i, remoteName);
    ReadOffsets(los[i], "local_offsets", i, &l[i]);
    ReadOffsets(ros[i], "remote_offsets", i, &r[i]);
    ReadOffsets(szs[i], "sizes", i, &z[i]);
  }
  profile::Mark(profile::kConverted);
  py::gil_scoped_release nogil;
  return e.BatchReadWrite(locals, l, remotes, r, z, ids, isRead);
}

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

I64Array Flat(py::handle h, const char* name) {
  I64Array a = I64Array::ensure(h);
  if (!a) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + " must be a 1-D integer array or list");
  }
  if (a.ndim() != 1) throw py::type_error(std::string(name) + " must be 1-D, got " + std::to_string(a.ndim()) + " dimensions");
  return a;
}

// See ExpandBlockSegments (io/segments.hpp). `runs`: (source layer offsets, destination layer
// offsets, source block stride, destination block stride, template source offsets, template
// destination offsets, template sizes) per run of layers of one geometry.
py::tuple ExpandBlockSegmentsPy(py::sequence runs, py::handle srcBlocks, py::handle dstBlocks) {
  const I64Array sb = Flat(srcBlocks, "src_blocks"), db = Flat(dstBlocks, "dst_blocks");
  if (sb.size() != db.size())
    throw mori::InvalidArgument("src_blocks and dst_blocks differ in length (" + std::to_string(sb.size()) + " vs " +
                                std::to_string(db.size()) + ")");
  std::vector<I64Array> keep;  // the runs' arrays, alive while their pointers are used
  std::vector<BlockRun> rs;
  const size_t blocks = static_cast<size_t>(sb.size());
  size_t total = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    py::sequence t = runs[i].cast<py::sequence>();
    if (t.size() != 7) throw py::type_error("runs[" + std::to_string(i) + "] must be a sequence of 7 items");
    I64Array os = Flat(t[0], "layer source offsets"), od = Flat(t[1], "layer destination offsets");
    I64Array ts = Flat(t[4], "template source offsets"), td = Flat(t[5], "template destination offsets"),
             tz = Flat(t[6], "template sizes");
    if (os.size() != od.size() || ts.size() != td.size() || ts.size() != tz.size())
      throw mori::InvalidArgument("runs[" + std::to_string(i) + "]: layer offsets or template arrays differ in length");
    BlockRun r{os.data(), od.data(), static_cast<size_t>(os.size()), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
               ts.data(), td.data(), tz.data(), static_cast<size_t>(ts.size())};
    total += r.layers * blocks * r.tmplLen;
    rs.push_back(r);
    keep.push_back(std::move(os));
    keep.push_back(std::move(od));
    keep.push_back(std::move(ts));
    keep.push_back(std::move(td));
    keep.push_back(std::move(tz));
  }
  py::array_t<int64_t> lo(static_cast<py::ssize_t>(total)), ro(static_cast<py::ssize_t>(total)),
      sz(static_cast<py::ssize_t>(total));
  const size_t n = ExpandBlockSegments(rs, sb.data(), db.data(), blocks, lo.mutable_data(), ro.mutable_data(),
                                       sz.mutable_data());
  const py::slice head(0, static_cast<py::ssize_t>(n), 1);
  return py::make_tuple(lo[head], ro[head], sz[head]);
}

}  // namespace

void RegisterIo(py::module_& m) {
  py::enum_<BackendType>(m, "BackendType", "Transport of the IO engine.")
      .value("Unknown", BackendType::Unknown)
      .value("XGMI", BackendType::XGMI, "intra-node GPU<->GPU (CUDA IPC over NVLink/PCIe on NVIDIA)")
      .value("RDMA", BackendType::RDMA)
      .value("TCP", BackendType::TCP)
      .value("FABRIC", BackendType::FABRIC)
      .export_values();
  py::enum_<MemoryLocationType>(m, "MemoryLocationType")
      .value("Unknown", MemoryLocationType::Unknown)
      .value("CPU", MemoryLocationType::CPU)
      .value("GPU", MemoryLocationType::GPU)
      .export_values();
  py::enum_<StatusCode>(m, "StatusCode")
      .value("SUCCESS", StatusCode::SUCCESS)
      .value("INIT", StatusCode::INIT)
      .value("IN_PROGRESS", StatusCode::IN_PROGRESS)
      .value("ERR_INVALID_ARGS", StatusCode::ERR_INVALID_ARGS)
      .value("ERR_NOT_FOUND", StatusCode::ERR_NOT_FOUND)
      .value("ERR_RDMA_OP", StatusCode::ERR_RDMA_OP)
      .value("ERR_BAD_STATE", StatusCode::ERR_BAD_STATE)
      .value("ERR_GPU_OP", StatusCode::ERR_GPU_OP)
      .export_values();
  py::enum_<PollCqMode>(m, "PollCqMode").value("POLLING", PollCqMode::POLLING).value("EVENT", PollCqMode::EVENT).export_values();

  py::class_<IOEngineConfig>(m, "IOEngineConfig", "Engine configuration: address of the control-plane listener.")
      .def(py::init([](const std::string& host, uint16_t port, const std::string& authSecret, bool enableAutoXgmi) {
             IOEngineConfig c;
             c.host = host;
             c.port = port;
             c.authSecret = authSecret;
             c.enableAutoXgmi = enableAutoXgmi;
             return c;
           }),
           py::arg("host") = "", py::arg("port") = 0, py::kw_only(), py::arg("auth_secret") = "",
           py::arg("enable_auto_xgmi") = true)
      .def_readwrite("host", &IOEngineConfig::host)
      .def_readwrite("port", &IOEngineConfig::port)
      .def_readwrite("auth_secret", &IOEngineConfig::authSecret)
      .def_readwrite("enable_auto_xgmi", &IOEngineConfig::enableAutoXgmi)
      .def("__repr__", [](const IOEngineConfig& c) {
        return "IOEngineConfig(host='" + c.host + "', port=" + std::to_string(c.port) +
               (c.authSecret.empty() ? "" : ", auth_secret=<set>") + ")";
      });

  py::class_<BackendConfig>(m, "BackendConfig");

  py::class_<TcpBackendConfig, BackendConfig>(m, "TcpBackendConfig", "Configuration of BackendType.TCP.")
      .def(py::init([](int numConnections, uint64_t chunkBytes, uint64_t minChunkBytes, int64_t opTimeoutMs,
                       int64_t connectTimeoutMs, uint64_t stagingBytes, bool enableNotification, int sockBufBytes,
                       int64_t heartbeatTimeoutMs) {
             TcpBackendConfig c;
             c.numConnections = numConnections;
             c.chunkBytes = chunkBytes;
             c.minChunkBytes = minChunkBytes;
             c.opTimeoutMs = opTimeoutMs;
             c.connectTimeoutMs = connectTimeoutMs;
             c.stagingBytes = stagingBytes;
             c.enableNotification = enableNotification;
             c.sockBufBytes = sockBufBytes;
             c.heartbeatTimeoutMs = heartbeatTimeoutMs;
             return c;
           }),
           py::arg("num_connections") = 4, py::arg("chunk_bytes") = 4ull << 20, py::arg("min_chunk_bytes") = 1ull << 20,
           py::arg("op_timeout_ms") = 10000, py::arg("connect_timeout_ms") = 2000, py::arg("staging_bytes") = 4ull << 20,
           py::arg("enable_notification") = true, py::arg("sock_buf_bytes") = 4 << 20,
           py::arg("heartbeat_timeout_ms") = 1500)
      .def_readwrite("num_connections", &TcpBackendConfig::numConnections)
      .def_readwrite("chunk_bytes", &TcpBackendConfig::chunkBytes)
      .def_readwrite("min_chunk_bytes", &TcpBackendConfig::minChunkBytes)
      .def_readwrite("op_timeout_ms", &TcpBackendConfig::opTimeoutMs)
      .def_readwrite("connect_timeout_ms", &TcpBackendConfig::connectTimeoutMs)
      .def_readwrite("staging_bytes", &TcpBackendConfig::stagingBytes)
      .def_readwrite("enable_notification", &TcpBackendConfig::enableNotification)
      .def_readwrite("sock_buf_bytes", &TcpBackendConfig::sockBufBytes)
      .def_readwrite("heartbeat_timeout_ms", &TcpBackendConfig::heartbeatTimeoutMs);

  py::class_<RdmaBackendConfig, BackendConfig>(m, "RdmaBackendConfig", "Configuration of BackendType.RDMA.")
      .def(py::init([](int qp, int postBatch, int workers, PollCqMode mode, bool notif, int notifPerQp, bool chunking,
                       uint64_t chunkBytes, int maxChunks, int nics) {
             RdmaBackendConfig c;
             c.qpPerTransfer = qp;
             c.postBatchSize = postBatch;
             c.numWorkerThreads = workers;
             c.pollCqMode = mode;
             c.enableNotification = notif;
             c.notifPerQp = notifPerQp;
             c.enableTransferChunking = chunking;
             c.chunkBytes = chunkBytes;
             c.maxChunksPerTransfer = maxChunks;
             c.numNicsPerTransfer = nics;
             return c;
           }),
           py::arg("qp_per_transfer") = 1, py::arg("post_batch_size") = -1, py::arg("num_worker_threads") = -1,
           py::arg("poll_cq_mode") = PollCqMode::POLLING, py::arg("enable_notification") = true,
           py::arg("notif_per_qp") = 1024, py::arg("enable_transfer_chunking") = false, py::arg("chunk_bytes") = 65536,
           py::arg("max_chunks_per_transfer") = 64, py::arg("num_nics_per_transfer") = 1)
      .def_readwrite("qp_per_transfer", &RdmaBackendConfig::qpPerTransfer)
      .def_readwrite("post_batch_size", &RdmaBackendConfig::postBatchSize)
      .def_readwrite("num_worker_threads", &RdmaBackendConfig::numWorkerThreads)
      .def_readwrite("poll_cq_mode", &RdmaBackendConfig::pollCqMode)
      .def_readwrite("enable_notification", &RdmaBackendConfig::enableNotification)
      .def_readwrite("notif_per_qp", &RdmaBackendConfig::notifPerQp)
      .def_readwrite("enable_transfer_chunking", &RdmaBackendConfig::enableTransferChunking)
      .def_readwrite("chunk_bytes", &RdmaBackendConfig::chunkBytes)
      .def_readwrite("max_chunks_per_transfer", &RdmaBackendConfig::maxChunksPerTransfer)
      .def_readwrite("num_nics_per_transfer", &RdmaBackendConfig::numNicsPerTransfer)
      .def_readwrite("max_send_wr", &RdmaBackendConfig::maxSendWr)
      .def_readwrite("max_cqe_num", &RdmaBackendConfig::maxCqeNum)
      .def_readwrite("max_msg_sge", &RdmaBackendConfig::maxMsgSge);

  py::class_<XgmiBackendConfig, BackendConfig>(m, "XgmiBackendConfig", "Configuration of BackendType.XGMI.")
      .def(py::init([](int streams, int events, bool notify, int proxyBlocks, int64_t proxyMaxBytes,
                       int64_t proxyIdleUs) {
             XgmiBackendConfig c;
             c.numStreams = streams;
             c.numEvents = events;
             c.enableNotification = notify;
             c.proxyBlocks = proxyBlocks;
             c.proxyMaxBytes = proxyMaxBytes;
             c.proxyIdleUs = proxyIdleUs;
             return c;
           }),
           py::arg("num_streams") = 64, py::arg("num_events") = 64, py::kw_only(),
           py::arg("enable_notification") = true, py::arg("proxy_blocks") = 0,
           py::arg("proxy_max_bytes") = 1ll << 20, py::arg("proxy_idle_us") = 500,
           "proxy_blocks > 0 keeps a copy kernel of that many blocks resident on each initiating GPU for "
           "transfers of at most proxy_max_bytes and 64 segments (no launch per transfer; holds SMs; a "
           "device-wide synchronize waits until it leaves, proxy_idle_us after its last transfer). See docs/io.md.")
      .def_readwrite("num_streams", &XgmiBackendConfig::numStreams)
      .def_readwrite("num_events", &XgmiBackendConfig::numEvents)
      .def_readwrite("enable_notification", &XgmiBackendConfig::enableNotification)
      .def_readwrite("proxy_blocks", &XgmiBackendConfig::proxyBlocks)
      .def_readwrite("proxy_max_bytes", &XgmiBackendConfig::proxyMaxBytes)
      .def_readwrite("proxy_idle_us", &XgmiBackendConfig::proxyIdleUs);

  py::class_<EngineDesc>(m, "EngineDesc", "Identity and address of an IO engine; exchange it with pack()/unpack().")
      .def_readonly("key", &EngineDesc::key)
      .def_readonly("node_id", &EngineDesc::nodeId)
      .def_readonly("hostname", &EngineDesc::hostname)
      .def_readonly("host", &EngineDesc::host)
      .def_readonly("port", &EngineDesc::port)
      .def_readonly("pid", &EngineDesc::pid)
      .def("pack", [](const EngineDesc& d) { return ToBytes(d.Pack()); })
      .def_static("unpack", &FromBytes<EngineDesc>, py::arg("packed"))
      .def("__eq__", [](const EngineDesc& a, const EngineDesc& b) { return a == b; })
      .def("__hash__", [](const EngineDesc& d) { return std::hash<std::string>()(d.key); })
      .def(py::pickle([](const EngineDesc& d) { return ToBytes(d.Pack()); },
                      [](const py::bytes& b) { return FromBytes<EngineDesc>(b); }))
      .def("__repr__", [](const EngineDesc& d) {
        return "EngineDesc(key='" + d.key + "', host='" + d.host + "', port=" + std::to_string(d.port) +
               ", pid=" + std::to_string(d.pid) + ")";
      });

  py::class_<MemoryDesc>(m, "MemoryDesc", "A registered memory region; exchange it with pack()/unpack().")
      .def(py::init<>())
      .def_readonly("engine_key", &MemoryDesc::engineKey)
      .def_readonly("id", &MemoryDesc::id)
      .def_readonly("device_id", &MemoryDesc::deviceId)
      .def_readonly("device_bus_id", &MemoryDesc::deviceBusId)
      .def_readonly("data", &MemoryDesc::data)
      .def_readonly("size", &MemoryDesc::size)
      .def_readonly("loc", &MemoryDesc::loc)
      .def_readonly("numa_node", &MemoryDesc::numaNode)
      .def_readonly("ipc_offset", &MemoryDesc::ipcOffset)
      .def_property_readonly("ipc_handle", [](const MemoryDesc& d) {
        return py::bytes(reinterpret_cast<const char*>(d.ipcHandle.data()), d.ipcHandle.size());
      })
      .def("pack", [](const MemoryDesc& d) { return ToBytes(d.Pack()); })
      .def_static("unpack", &FromBytes<MemoryDesc>, py::arg("packed"))
      .def("__eq__", [](const MemoryDesc& a, const MemoryDesc& b) { return a == b; })
      .def("__hash__", [](const MemoryDesc& d) { return std::hash<std::string>()(d.engineKey) ^ d.id; })
      .def(py::pickle([](const MemoryDesc& d) { return ToBytes(d.Pack()); },
                      [](const py::bytes& b) { return FromBytes<MemoryDesc>(b); }))
      .def("__repr__", [](const MemoryDesc& d) {
        return "MemoryDesc(engine_key='" + d.engineKey + "', id=" + std::to_string(d.id) + ", loc=" +
               ToString(d.loc) + ", device_id=" + std::to_string(d.deviceId) + ", size=" + std::to_string(d.size) + ")";
      });

  py::class_<TransferStatus, StatusPtr>(m, "TransferStatus",
                                        "Completion record of one transfer. The first error wins; Wait() and "
                                        "WaitFor() release the GIL.")
      .def(py::init<>())
      .def("Code", &TransferStatus::Code)
      .def("Message", &TransferStatus::Message)
      .def("Init", &TransferStatus::Init)
      .def("InProgress", &TransferStatus::InProgress)
      .def("Succeeded", &TransferStatus::Succeeded)
      .def("Failed", &TransferStatus::Failed)
      .def("Update", &TransferStatus::Update, py::arg("code"), py::arg("message") = "")
      .def("SetCode", &TransferStatus::SetCode, py::arg("code"))
      .def("SetMessage", &TransferStatus::SetMessage, py::arg("message"))
      .def("Wait", &TransferStatus::Wait, py::call_guard<py::gil_scoped_release>())
      .def("WaitFor", &TransferStatus::WaitFor, py::arg("timeout_ms") = -1, py::call_guard<py::gil_scoped_release>())
      .def("__repr__", [](TransferStatus& s) {
        std::string msg = s.Message();
        return std::string("TransferStatus(") + ToString(s.Code()) + (msg.empty() ? "" : ", '" + msg + "'") + ")";
      });

  m.def("expand_block_segments", &ExpandBlockSegmentsPy, py::arg("runs"), py::arg("src_blocks"), py::arg("dst_blocks"),
        "KV-cache plan: (source offsets, destination offsets, sizes) int64 arrays of every run x layer x block pair "
        "x template piece, merged where they continue each other (see mori_core.io.expand_block_segments).");
  m.def("wait_all", &WaitAll, py::arg("statuses"), py::arg("timeout_ms") = -1,
        py::call_guard<py::gil_scoped_release>(),
        "Wait for every status: SUCCESS, the first error seen, or IN_PROGRESS on timeout.");

  m.def(
      "io_profile", [](bool enable) { profile::gEnabled.store(enable); }, py::arg("enable"),
      "Turn on (or off) the timestamps that transfers record on the calling thread (see io_profile_last).");
  m.def(
      "io_profile_last",
      [] {
        py::dict d;
        const profile::Stamps& st = profile::ThreadStamps();
        for (int k = 0; k < profile::kStampCount; ++k)
          d[profile::StampName(static_cast<profile::Stamp>(k))] = st.ns[k];
        d["path"] = profile::PathName(st.path);
        return d;
      },
      "CLOCK_MONOTONIC nanoseconds (time.perf_counter_ns' clock) at the stages of this thread's last transfer "
      "submission: enter, converted, validated, launch_begin, launch_end, submitted (0 = not reached); 'path': "
      "how an XGMI copy was started ('kernel', 'copy_engines', 'proxy'; 'none' otherwise).");

  using Session = IOEngineSession;
  py::class_<Session>(m, "IOEngineSession")
      .def("allocate_transfer_uid", &Session::AllocateTransferUniqueId)
      .def(
          "read",
          [](Session& s, uint64_t lo, uint64_t ro, uint64_t size, TransferUniqueId uid) {
            return Single([&] { return s.Read(lo, ro, size, uid); });
          },
          py::arg("local_offset"), py::arg("remote_offset"), py::arg("size"), py::arg("transfer_uid"))
      .def(
          "write",
          [](Session& s, uint64_t lo, uint64_t ro, uint64_t size, TransferUniqueId uid) {
            return Single([&] { return s.Write(lo, ro, size, uid); });
          },
          py::arg("local_offset"), py::arg("remote_offset"), py::arg("size"), py::arg("transfer_uid"))
      .def(
          "batch_read",
          [](Session& s, py::handle lo, py::handle ro, py::handle sz, TransferUniqueId uid) {
            return SessionBatch(s, lo, ro, sz, uid, true);
          },
          py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uid"))
      .def(
          "batch_write",
          [](Session& s, py::handle lo, py::handle ro, py::handle sz, TransferUniqueId uid) {
            return SessionBatch(s, lo, ro, sz, uid, false);
          },
          py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uid"))
      .def("alive", &Session::Alive);

  py::class_<IOEngine>(m, "IOEngine")
      .def(py::init<const std::string&, const IOEngineConfig&>(), py::arg("key"), py::arg("config"))
      .def("get_engine_desc", &IOEngine::GetEngineDesc)
      .def(
          "create_backend",
          [](IOEngine& e, BackendType t, const BackendConfig* c) { e.CreateBackend(t, c); }, py::arg("type"),
          py::arg("config") = nullptr, py::call_guard<py::gil_scoped_release>())
      .def("remove_backend", &IOEngine::RemoveBackend, py::arg("type"), py::call_guard<py::gil_scoped_release>())
      .def("has_backend", &IOEngine::HasBackend, py::arg("type"))
      .def("backends", &IOEngine::Backends)
      .def("register_remote_engine", &IOEngine::RegisterRemoteEngine, py::arg("engine_desc"))
      .def("deregister_remote_engine", &IOEngine::DeregisterRemoteEngine, py::arg("engine_desc"),
           py::call_guard<py::gil_scoped_release>())
      .def("register_memory", &IOEngine::RegisterMemory, py::arg("ptr"), py::arg("size"), py::arg("device_id"),
           py::arg("mem_loc"))
      .def("deregister_memory", &IOEngine::DeregisterMemory, py::arg("mem_desc"),
           py::call_guard<py::gil_scoped_release>())
      .def("allocate_transfer_uid", &IOEngine::AllocateTransferUniqueId)
      .def(
          "read",
          [](IOEngine& e, const MemoryDesc& l, uint64_t lo, const MemoryDesc& r, uint64_t ro, uint64_t size,
             TransferUniqueId uid) { return Single([&] { return e.Read(l, lo, r, ro, size, uid); }); },
          py::arg("local_dest_mem_desc"), py::arg("local_offset"), py::arg("remote_src_mem_desc"),
          py::arg("remote_offset"), py::arg("size"), py::arg("transfer_uid"))
      .def(
          "write",
          [](IOEngine& e, const MemoryDesc& l, uint64_t lo, const MemoryDesc& r, uint64_t ro, uint64_t size,
             TransferUniqueId uid) { return Single([&] { return e.Write(l, lo, r, ro, size, uid); }); },
          py::arg("local_src_mem_desc"), py::arg("local_offset"), py::arg("remote_dest_mem_desc"),
          py::arg("remote_offset"), py::arg("size"), py::arg("transfer_uid"))
      .def(
          "batch_read",
          [](IOEngine& e, py::handle lm, py::handle lo, py::handle rm, py::handle ro, py::handle sz,
             py::handle uids) {
            return EngineBatch(e, lm, lo, rm, ro, sz, uids, true, "local_dest_mem_descs", "remote_src_mem_descs");
          },
          py::arg("local_dest_mem_descs"), py::arg("local_offsets"), py::arg("remote_src_mem_descs"),
          py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uids"))
      .def(
          "batch_write",
          [](IOEngine& e, py::handle lm, py::handle lo, py::handle rm, py::handle ro, py::handle sz,
             py::handle uids) {
            return EngineBatch(e, lm, lo, rm, ro, sz, uids, false, "local_src_mem_descs", "remote_dest_mem_descs");
          },
          py::arg("local_src_mem_descs"), py::arg("local_offsets"), py::arg("remote_dest_mem_descs"),
          py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uids"))
      .def(
          "create_session",
          [](IOEngine& e, const MemoryDesc& l, const MemoryDesc& r) {
            std::string why;
            auto s = e.CreateSession(l, r, &why);
            return std::make_pair(std::move(s), why);
          },
          py::arg("local_mem_desc"), py::arg("remote_mem_desc"), py::call_guard<py::gil_scoped_release>(),
          "Returns (session or None, reason when None).")
      .def(
          "route_of",
          [](IOEngine& e, const MemoryDesc& l, const MemoryDesc& r) {
            std::string why;
            auto t = e.RouteOf(l, r, &why);
            return std::make_pair(t, why);
          },
          py::arg("local_mem_desc"), py::arg("remote_mem_desc"))
      .def("pop_inbound_transfer_status", &IOEngine::PopInboundTransferStatus, py::arg("remote_key"),
           py::arg("transfer_uid"));
}

}  // namespace mori::bindings
