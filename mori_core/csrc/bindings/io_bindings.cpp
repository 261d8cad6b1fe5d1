// Bindings of MORI-IO. Names, argument order and defaults follow AMD's
// `mori.cpp` module; TcpBackendConfig and the auth fields are our additions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.hpp"
#include "io/engine.hpp"

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
                       int64_t connectTimeoutMs, uint64_t stagingBytes, bool enableNotification, int sockBufBytes) {
             TcpBackendConfig c;
             c.numConnections = numConnections;
             c.chunkBytes = chunkBytes;
             c.minChunkBytes = minChunkBytes;
             c.opTimeoutMs = opTimeoutMs;
             c.connectTimeoutMs = connectTimeoutMs;
             c.stagingBytes = stagingBytes;
             c.enableNotification = enableNotification;
             c.sockBufBytes = sockBufBytes;
             return c;
           }),
           py::arg("num_connections") = 4, py::arg("chunk_bytes") = 4ull << 20, py::arg("min_chunk_bytes") = 1ull << 20,
           py::arg("op_timeout_ms") = 10000, py::arg("connect_timeout_ms") = 2000, py::arg("staging_bytes") = 4ull << 20,
           py::arg("enable_notification") = true, py::arg("sock_buf_bytes") = 4 << 20)
      .def_readwrite("num_connections", &TcpBackendConfig::numConnections)
      .def_readwrite("chunk_bytes", &TcpBackendConfig::chunkBytes)
      .def_readwrite("min_chunk_bytes", &TcpBackendConfig::minChunkBytes)
      .def_readwrite("op_timeout_ms", &TcpBackendConfig::opTimeoutMs)
      .def_readwrite("connect_timeout_ms", &TcpBackendConfig::connectTimeoutMs)
      .def_readwrite("staging_bytes", &TcpBackendConfig::stagingBytes)
      .def_readwrite("enable_notification", &TcpBackendConfig::enableNotification)
      .def_readwrite("sock_buf_bytes", &TcpBackendConfig::sockBufBytes);

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
      .def(py::init([](int streams, int events, bool notify) {
             XgmiBackendConfig c;
             c.numStreams = streams;
             c.numEvents = events;
             c.enableNotification = notify;
             return c;
           }),
           py::arg("num_streams") = 64, py::arg("num_events") = 64, py::kw_only(),
           py::arg("enable_notification") = true)
      .def_readwrite("num_streams", &XgmiBackendConfig::numStreams)
      .def_readwrite("num_events", &XgmiBackendConfig::numEvents)
      .def_readwrite("enable_notification", &XgmiBackendConfig::enableNotification);

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

  m.def("wait_all", &WaitAll, py::arg("statuses"), py::arg("timeout_ms") = -1,
        py::call_guard<py::gil_scoped_release>(),
        "Wait for every status: SUCCESS, the first error seen, or IN_PROGRESS on timeout.");

  using Session = IOEngineSession;
  py::class_<Session>(m, "IOEngineSession")
      .def("allocate_transfer_uid", &Session::AllocateTransferUniqueId)
      .def("read", &Session::Read, py::arg("local_offset"), py::arg("remote_offset"), py::arg("size"),
           py::arg("transfer_uid"), py::call_guard<py::gil_scoped_release>())
      .def("write", &Session::Write, py::arg("local_offset"), py::arg("remote_offset"), py::arg("size"),
           py::arg("transfer_uid"), py::call_guard<py::gil_scoped_release>())
      .def(
          "batch_read",
          [](Session& s, const Offsets& lo, const Offsets& ro, const Offsets& sz, TransferUniqueId uid) {
            return s.BatchReadWrite(lo, ro, sz, uid, true);
          },
          py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uid"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "batch_write",
          [](Session& s, const Offsets& lo, const Offsets& ro, const Offsets& sz, TransferUniqueId uid) {
            return s.BatchReadWrite(lo, ro, sz, uid, false);
          },
          py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uid"),
          py::call_guard<py::gil_scoped_release>())
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
      .def("read", &IOEngine::Read, py::arg("local_dest_mem_desc"), py::arg("local_offset"),
           py::arg("remote_src_mem_desc"), py::arg("remote_offset"), py::arg("size"), py::arg("transfer_uid"),
           py::call_guard<py::gil_scoped_release>())
      .def("write", &IOEngine::Write, py::arg("local_src_mem_desc"), py::arg("local_offset"),
           py::arg("remote_dest_mem_desc"), py::arg("remote_offset"), py::arg("size"), py::arg("transfer_uid"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "batch_read",
          [](IOEngine& e, const std::vector<MemoryDesc>& lm, const std::vector<Offsets>& lo,
             const std::vector<MemoryDesc>& rm, const std::vector<Offsets>& ro, const std::vector<Offsets>& sz,
             const std::vector<TransferUniqueId>& uids) { return e.BatchReadWrite(lm, lo, rm, ro, sz, uids, true); },
          py::arg("local_dest_mem_descs"), py::arg("local_offsets"), py::arg("remote_src_mem_descs"),
          py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uids"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "batch_write",
          [](IOEngine& e, const std::vector<MemoryDesc>& lm, const std::vector<Offsets>& lo,
             const std::vector<MemoryDesc>& rm, const std::vector<Offsets>& ro, const std::vector<Offsets>& sz,
             const std::vector<TransferUniqueId>& uids) { return e.BatchReadWrite(lm, lo, rm, ro, sz, uids, false); },
          py::arg("local_src_mem_descs"), py::arg("local_offsets"), py::arg("remote_dest_mem_descs"),
          py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uids"),
          py::call_guard<py::gil_scoped_release>())
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
