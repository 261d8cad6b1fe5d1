#include "io/tcp/inbound.hpp"

#include <vector>

#include "common/logging.hpp"
#include "io/net/log_limiter.hpp"
#include "io/segments.hpp"
#include "io/tcp/gpu_staging.hpp"
#include "io/tcp/wire.hpp"

namespace mori::io::tcp {
namespace {

bool SendReply(net::Socket& sock, net::FrameMac& mac, ReplyKind kind, StatusCode code, uint64_t requestId,
               const std::string& message, uint64_t dataBytes, int64_t timeoutMs, std::string* err) {
  std::string msg = message.substr(0, kMaxReplyMessage);
  ReplyHeader r{};
  r.magic = kFrameMagic;
  r.kind = static_cast<uint8_t>(kind);
  r.code = static_cast<uint8_t>(code);
  r.messageLen = static_cast<uint16_t>(msg.size());
  r.requestId = requestId;
  r.dataBytes = dataBytes;
  SignReply(mac, r, msg.data(), msg.size());
  struct iovec iov[2] = {{&r, sizeof(r)}, {msg.data(), msg.size()}};
  return sock.SendV(iov, 2, timeoutMs, err);
}

// Forgets the socket in the cut handle when the connection ends, before the
// listener closes the descriptor.
struct DetachOnExit {
  CutPtr cut;
  ~DetachOnExit() { cut->Detach(); }
};

}  // namespace

void ServeDataChannel(EngineContext& ctx, const TcpBackendConfig& cfg, net::Socket& sock, const net::PeerHello& peer,
                      const std::atomic<bool>& stopping) {
  sock.ConfigureForBulk(cfg.sockBufBytes, cfg.opTimeoutMs);
  const int64_t t = cfg.opTimeoutMs;
  const std::string who = "TCP data channel from engine '" + peer.engineKey + "' (" + peer.address + ")";
  const int64_t idle = peer.idleTimeoutMs > 0 ? peer.idleTimeoutMs : -1;
  net::FrameMac rx = peer.keys.ForReceiving(false), tx = peer.keys.ForSending(false);
  // Deregistration of a region this connection writes or reads cuts it.
  DetachOnExit cut{std::make_shared<CutHandle>(sock.fd())};
  uint64_t expectedId = 1;
  DeviceStager stager(cfg.stagingBytes);
  std::vector<WireSegment> table;
  std::vector<struct iovec> iov;
  std::vector<ByteRange> ranges;
  std::string err;

  while (!stopping.load()) {
    RequestHeader h{};
    // Wait for the next request up to the idle bound (initiators close idle
    // connections before it), then require the rest of the header promptly.
    if (!sock.RecvAll(&h, 1, idle, &err, &stopping)) {
      if (err.rfind("timed out", 0) == 0) err = "idle for " + std::to_string(idle) + " ms, closed";
      break;
    }
    if (!sock.RecvAll(reinterpret_cast<uint8_t*>(&h) + 1, sizeof(h) - 1, t, &err)) break;
    std::string bad = ValidateRequestHeader(h);
    if (bad.empty() && h.requestId != expectedId)
      bad = "request id " + std::to_string(h.requestId) + ", expected " + std::to_string(expectedId);
    if (!bad.empty()) {
      MORI_WARN_REMOTE(peer.address, who << ": dropping connection, malformed request (" << bad << ")");
      return;
    }
    table.resize(h.numSegments);
    if (!sock.RecvAll(table.data(), table.size() * sizeof(WireSegment), t, &err)) break;
    if (!VerifyRequest(rx, h, table.data(), table.size() * sizeof(WireSegment))) {
      MORI_WARN_REMOTE(peer.address, who << ": dropping connection, request " << h.requestId
                                         << " failed authentication (not from the engine that completed the "
                                            "handshake: a relayed or injected frame)");
      return;
    }
    ++expectedId;
    uint64_t sum = 0;
    bool overflow = false;
    for (const auto& s : table) {
      if (s.size > kMaxFrameBytes) overflow = true;
      sum += s.size;
    }
    if (overflow || sum != h.totalBytes) {
      MORI_WARN_REMOTE(peer.address, who << ": dropping connection, segment sizes do not add up to the frame payload");
      return;
    }

    const bool isWrite = h.op == static_cast<uint8_t>(Op::Write);
    RegionPin pin = ctx.memory.Pin(h.memId);
    StatusCode code = StatusCode::SUCCESS;
    std::string refusal;
    if (!pin) {
      code = StatusCode::ERR_NOT_FOUND;
      refusal = "memory id " + std::to_string(h.memId) + " is not registered on engine '" + ctx.key + "'";
    } else {
      for (size_t i = 0; i < table.size() && code == StatusCode::SUCCESS; ++i) {
        std::string e = CheckRangeInRegion(table[i].offset, table[i].size, pin.desc().size);
        if (!e.empty()) {
          code = StatusCode::ERR_INVALID_ARGS;
          refusal = "segment " + std::to_string(i) + ": " + e;
        }
      }
    }
    if (code != StatusCode::SUCCESS) {
      MORI_INFO(who << ": refused request " << h.requestId << ": " << refusal);
      if (isWrite && !sock.Discard(h.totalBytes, t, &err)) break;
      if (!SendReply(sock, tx, ReplyKind::Error, code, h.requestId, refusal, 0, t, &err)) break;
      continue;
    }

    pin.Attach(cut.cut);
    const MemoryDesc& mem = pin.desc();
    uint8_t* base = pin.base();
    const bool onGpu = mem.loc == MemoryLocationType::GPU;
    bool ok;
    if (onGpu) {
      ranges.clear();
      for (const auto& s : table) ranges.emplace_back(s.offset, s.size);
    } else {
      iov.clear();
      for (const auto& s : table) iov.push_back({base + s.offset, s.size});
    }
    if (isWrite) {
      ok = onGpu ? stager.RecvToDevice(sock, mem.deviceId, base, ranges, t, &err)
                 : sock.RecvV(iov.data(), iov.size(), t, &err);
      if (!ok) break;
      pin = RegionPin();
      // Record before acknowledging: once the initiator sees SUCCESS, the
      // target's pop_inbound_transfer_status already reports it.
      if (h.flags & kFlagNotify) ctx.notifications.Record(peer.engineKey, h.uid, h.notifyTotal);
      if (!SendReply(sock, tx, ReplyKind::Ack, StatusCode::SUCCESS, h.requestId, "", 0, t, &err)) break;
    } else {
      if (!SendReply(sock, tx, ReplyKind::ReadData, StatusCode::SUCCESS, h.requestId, "", h.totalBytes, t, &err))
        break;
      ok = onGpu ? stager.SendFromDevice(sock, mem.deviceId, base, ranges, t, &err)
                 : sock.SendV(iov.data(), iov.size(), t, &err);
      if (!ok) break;
      pin = RegionPin();
      if (h.flags & kFlagNotify) ctx.notifications.Record(peer.engineKey, h.uid, h.notifyTotal);
    }
  }
  if (cut.cut->IsCut())
    MORI_INFO(who << " cut: a region it was moving bytes of was deregistered");
  else if (!stopping.load() && err != "connection closed by peer")
    MORI_INFO(who << " closed: " << err);
}

}  // namespace mori::io::tcp
