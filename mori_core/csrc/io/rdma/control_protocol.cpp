#include "io/rdma/control_protocol.hpp"

#include <algorithm>

#include "common/byte_codec.hpp"
#include "common/error.hpp"

namespace mori::io::rdma {
namespace {

ByteWriter Header(MsgType t) {
  ByteWriter w;
  w.Put<uint32_t>(kControlMagic);
  w.Put<uint16_t>(kControlVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(t));
  return w;
}

std::string Clip(const std::string& s, size_t n) { return s.size() > n ? s.substr(0, n) : s; }

ByteReader Open(const std::vector<uint8_t>& body, MsgType expected, const char* what) {
  if (body.size() > kMaxControlBytes) throw InvalidArgument(std::string(what) + ": message too large");
  ByteReader r(body.data(), body.size(), what);
  if (r.Get<uint32_t>() != kControlMagic) throw InvalidArgument(std::string(what) + ": bad magic");
  uint16_t v = r.Get<uint16_t>();
  if (v != kControlVersion)
    throw InvalidArgument(std::string(what) + ": protocol version " + std::to_string(v) + ", expected " +
                          std::to_string(kControlVersion) + " (both engines must run the same mori-suite)");
  uint8_t t = r.Get<uint8_t>();
  if (t != static_cast<uint8_t>(expected))
    throw InvalidArgument(std::string(what) + ": unexpected message type " + std::to_string(t));
  return r;
}

void Close(const ByteReader& r, const char* what) {
  if (r.remaining() != 0) throw InvalidArgument(std::string(what) + ": trailing bytes");
}

StatusCode GetCode(ByteReader& r, const char* what) {
  uint8_t c = r.Get<uint8_t>();
  auto code = static_cast<StatusCode>(c);
  if (code != StatusCode::SUCCESS && !IsError(code))
    throw InvalidArgument(std::string(what) + ": invalid status code " + std::to_string(c));
  return code;
}

void PutPort(ByteWriter& w, const PortAddress& p) {
  w.PutString(Clip(p.nic, kMaxNicNameBytes));
  w.Put<uint8_t>(p.port);
  w.Put<uint8_t>(p.linkLayer);
  w.Put<uint8_t>(p.activeMtu);
  w.Put<uint8_t>(p.maxRdAtomic);
  w.Put<uint16_t>(p.lid);
  w.Put<uint8_t>(p.useGrh);
  w.PutBytes(p.gid.data(), p.gid.size());
  w.Put<uint32_t>(p.maxMsgSize);
}

PortAddress GetPort(ByteReader& r, const char* what) {
  PortAddress p;
  p.nic = r.GetString(kMaxNicNameBytes);
  p.port = r.Get<uint8_t>();
  p.linkLayer = r.Get<uint8_t>();
  p.activeMtu = r.Get<uint8_t>();
  p.maxRdAtomic = r.Get<uint8_t>();
  p.lid = r.Get<uint16_t>();
  p.useGrh = r.Get<uint8_t>();
  r.GetBytes(p.gid.data(), p.gid.size());
  p.maxMsgSize = r.Get<uint32_t>();
  if (p.port == 0) throw InvalidArgument(std::string(what) + ": port number 0");
  if (p.linkLayer > 2) throw InvalidArgument(std::string(what) + ": unknown link layer " + std::to_string(p.linkLayer));
  if (p.activeMtu < 1 || p.activeMtu > 5) throw InvalidArgument(std::string(what) + ": invalid MTU code");
  return p;
}

void PutQps(ByteWriter& w, const std::vector<QpAddress>& qps) {
  w.Put<uint32_t>(static_cast<uint32_t>(qps.size()));
  for (const auto& q : qps) {
    w.Put<uint32_t>(q.qpn);
    w.Put<uint32_t>(q.psn);
  }
}

std::vector<QpAddress> GetQps(ByteReader& r, const char* what, bool allowEmpty) {
  uint32_t n = r.Get<uint32_t>();
  if (n > kMaxQpsPerGroup || (n == 0 && !allowEmpty))
    throw InvalidArgument(std::string(what) + ": " + std::to_string(n) + " QPs outside [1, " +
                          std::to_string(kMaxQpsPerGroup) + "]");
  std::vector<QpAddress> qps(n);
  for (auto& q : qps) {
    q.qpn = r.Get<uint32_t>() & 0xffffff;
    q.psn = r.Get<uint32_t>() & 0xffffff;
  }
  return qps;
}

}  // namespace

std::vector<uint8_t> Encode(const HelloRequest&) { return Header(MsgType::Hello).Take(); }

std::vector<uint8_t> Encode(const HelloReply& m) {
  ByteWriter w = Header(MsgType::HelloReply);
  w.Put<uint8_t>(m.linkLayerMask);
  w.Put<uint16_t>(m.numNics);
  return w.Take();
}

std::vector<uint8_t> Encode(const GetMemoryRequest& m) {
  ByteWriter w = Header(MsgType::GetMemory);
  w.Put<uint32_t>(m.memId);
  return w.Take();
}

std::vector<uint8_t> Encode(const MemoryInfoReply& m) {
  ByteWriter w = Header(MsgType::MemoryInfo);
  w.Put<uint8_t>(static_cast<uint8_t>(m.code));
  w.PutString(Clip(m.message, kMaxControlTextBytes));
  w.PutString(Clip(m.nic, kMaxNicNameBytes));
  w.Put<uint64_t>(m.addr);
  w.Put<uint64_t>(m.size);
  w.Put<uint32_t>(m.rkey);
  return w.Take();
}

std::vector<uint8_t> Encode(const ConnectRequest& m) {
  ByteWriter w = Header(MsgType::Connect);
  w.Put<uint64_t>(m.groupId);
  w.PutString(Clip(m.targetNic, kMaxNicNameBytes));
  PutPort(w, m.initiator);
  PutQps(w, m.qps);
  return w.Take();
}

std::vector<uint8_t> Encode(const ConnectedReply& m) {
  ByteWriter w = Header(MsgType::Connected);
  w.Put<uint8_t>(static_cast<uint8_t>(m.code));
  w.PutString(Clip(m.message, kMaxControlTextBytes));
  PutPort(w, m.target);
  PutQps(w, m.qps);
  return w.Take();
}

std::vector<uint8_t> Encode(const ReleaseRequest& m) {
  ByteWriter w = Header(MsgType::Release);
  size_t n = std::min(m.groupIds.size(), kMaxReleasePerMessage);
  w.Put<uint32_t>(static_cast<uint32_t>(n));
  for (size_t i = 0; i < n; ++i) w.Put<uint64_t>(m.groupIds[i]);
  return w.Take();
}

std::vector<uint8_t> Encode(const ReleasedReply&) { return Header(MsgType::Released).Take(); }

MsgType PeekType(const std::vector<uint8_t>& body) {
  if (body.size() > kMaxControlBytes) throw InvalidArgument("RDMA control message too large");
  ByteReader r(body.data(), body.size(), "RDMA control message");
  if (r.Get<uint32_t>() != kControlMagic) throw InvalidArgument("RDMA control message: bad magic");
  uint16_t v = r.Get<uint16_t>();
  if (v != kControlVersion)
    throw InvalidArgument("RDMA control message: protocol version " + std::to_string(v) + ", expected " +
                          std::to_string(kControlVersion));
  uint8_t t = r.Get<uint8_t>();
  if (t < static_cast<uint8_t>(MsgType::Hello) || t > static_cast<uint8_t>(MsgType::Released))
    throw InvalidArgument("RDMA control message: unknown type " + std::to_string(t));
  return static_cast<MsgType>(t);
}

HelloReply DecodeHelloReply(const std::vector<uint8_t>& body) {
  const char* what = "RDMA HelloReply";
  ByteReader r = Open(body, MsgType::HelloReply, what);
  HelloReply m;
  m.linkLayerMask = r.Get<uint8_t>();
  m.numNics = r.Get<uint16_t>();
  Close(r, what);
  return m;
}

GetMemoryRequest DecodeGetMemory(const std::vector<uint8_t>& body) {
  const char* what = "RDMA GetMemory";
  ByteReader r = Open(body, MsgType::GetMemory, what);
  GetMemoryRequest m;
  m.memId = r.Get<uint32_t>();
  Close(r, what);
  return m;
}

MemoryInfoReply DecodeMemoryInfo(const std::vector<uint8_t>& body) {
  const char* what = "RDMA MemoryInfo";
  ByteReader r = Open(body, MsgType::MemoryInfo, what);
  MemoryInfoReply m;
  m.code = GetCode(r, what);
  m.message = r.GetString(kMaxControlTextBytes);
  m.nic = r.GetString(kMaxNicNameBytes);
  m.addr = r.Get<uint64_t>();
  m.size = r.Get<uint64_t>();
  m.rkey = r.Get<uint32_t>();
  Close(r, what);
  if (m.code == StatusCode::SUCCESS && (m.nic.empty() || m.size == 0 || m.addr + m.size < m.addr))
    throw InvalidArgument(std::string(what) + ": incomplete memory description");
  return m;
}

ConnectRequest DecodeConnect(const std::vector<uint8_t>& body) {
  const char* what = "RDMA Connect";
  ByteReader r = Open(body, MsgType::Connect, what);
  ConnectRequest m;
  m.groupId = r.Get<uint64_t>();
  m.targetNic = r.GetString(kMaxNicNameBytes);
  m.initiator = GetPort(r, what);
  m.qps = GetQps(r, what, false);
  Close(r, what);
  return m;
}

ConnectedReply DecodeConnected(const std::vector<uint8_t>& body) {
  const char* what = "RDMA Connected";
  ByteReader r = Open(body, MsgType::Connected, what);
  ConnectedReply m;
  m.code = GetCode(r, what);
  m.message = r.GetString(kMaxControlTextBytes);
  if (m.code != StatusCode::SUCCESS) {
    // A refusal carries no usable address; the rest is ignored.
    return m;
  }
  m.target = GetPort(r, what);
  m.qps = GetQps(r, what, false);
  Close(r, what);
  return m;
}

ReleaseRequest DecodeRelease(const std::vector<uint8_t>& body) {
  const char* what = "RDMA Release";
  ByteReader r = Open(body, MsgType::Release, what);
  uint32_t n = r.Get<uint32_t>();
  if (n > kMaxReleasePerMessage)
    throw InvalidArgument(std::string(what) + ": " + std::to_string(n) + " groups exceed " +
                          std::to_string(kMaxReleasePerMessage));
  ReleaseRequest m;
  m.groupIds.resize(n);
  for (auto& g : m.groupIds) g = r.Get<uint64_t>();
  Close(r, what);
  return m;
}

void DecodeReleased(const std::vector<uint8_t>& body) {
  ByteReader r = Open(body, MsgType::Released, "RDMA Released");
  Close(r, "RDMA Released");
}

}  // namespace mori::io::rdma
