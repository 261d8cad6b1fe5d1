#include "io/tcp/gpu_staging.hpp"

#include "common/gpu_runtime.hpp"

namespace mori::io::tcp {

#if !MORI_WITH_GPU

DeviceStager::DeviceStager(uint64_t bytes) : half_(bytes / 2) {}
DeviceStager::~DeviceStager() = default;
void DeviceStager::Release() {}

static bool NoGpu(std::string* err) {
  *err = "GPU memory needs a CUDA/HIP build of mori_core (this build is CPU-only)";
  return false;
}
bool DeviceStager::SendFromDevice(net::Socket&, int, const uint8_t*, const std::vector<ByteRange>&, int64_t,
                                  std::string* err) {
  return NoGpu(err);
}
bool DeviceStager::RecvToDevice(net::Socket&, int, uint8_t*, const std::vector<ByteRange>&, int64_t,
                                std::string* err) {
  return NoGpu(err);
}

#else

namespace {

// One piece = the part of the range list that fits in a staging buffer.
struct PieceCopy {
  uint64_t devOffset;
  uint64_t hostOffset;
  uint64_t size;
};

class PieceCursor {
 public:
  PieceCursor(const std::vector<ByteRange>& r, uint64_t cap) : ranges_(r), cap_(cap) {}
  bool Done() const { return idx_ >= ranges_.size(); }
  // Fills `out` with the next piece; returns its byte count.
  uint64_t Next(std::vector<PieceCopy>* out) {
    out->clear();
    uint64_t used = 0;
    while (idx_ < ranges_.size() && used < cap_) {
      const auto& [off, size] = ranges_[idx_];
      uint64_t take = std::min(size - within_, cap_ - used);
      if (take > 0) out->push_back({off + within_, used, take});
      used += take;
      within_ += take;
      if (within_ == size) {
        ++idx_;
        within_ = 0;
      }
    }
    return used;
  }

 private:
  const std::vector<ByteRange>& ranges_;
  uint64_t cap_;
  size_t idx_ = 0;
  uint64_t within_ = 0;
};

bool GpuOk(gpuError_t e, const char* what, std::string* err) {
  if (e == gpuSuccess) return true;
  *err = std::string(what) + ": " + gpuGetErrorString(e);
  return false;
}

}  // namespace

DeviceStager::DeviceStager(uint64_t bytes) : half_(std::max<uint64_t>(bytes / 2, 64 << 10)) {}

DeviceStager::~DeviceStager() { Release(); }

void DeviceStager::Release() {
  if (device_ < 0) return;
  DeviceGuard g(device_);
  for (int i = 0; i < 2; ++i) {
    if (events_[i]) gpuEventDestroy(static_cast<gpuEvent_t>(events_[i]));
    if (buf_[i]) gpuFreeHost(buf_[i]);
    events_[i] = nullptr;
    buf_[i] = nullptr;
  }
  if (stream_) gpuStreamDestroy(static_cast<gpuStream_t>(stream_));
  stream_ = nullptr;
  device_ = -1;
}

bool DeviceStager::Ensure(int device, std::string* err) {
  if (device_ == device) return true;
  Release();  // first use, or moving to another device: build the stream/events there
  DeviceGuard g(device);
  gpuStream_t s;
  if (!GpuOk(gpuStreamCreateWithFlags(&s, gpuStreamNonBlocking), "stream create", err)) return false;
  stream_ = s;
  for (int i = 0; i < 2; ++i) {
    gpuEvent_t e;
    if (!GpuOk(gpuEventCreateWithFlags(&e, gpuEventDisableTiming), "event create", err)) return false;
    events_[i] = e;
    void* p = nullptr;
    if (!GpuOk(gpuHostAlloc(&p, half_, gpuHostAllocDefault), "pinned staging alloc", err)) return false;
    buf_[i] = static_cast<uint8_t*>(p);
  }
  device_ = device;
  return true;
}

bool DeviceStager::SendFromDevice(net::Socket& sock, int device, const uint8_t* base,
                                  const std::vector<ByteRange>& ranges, int64_t timeoutMs, std::string* err) {
  DeviceGuard g(device);
  if (!Ensure(device, err)) return false;
  auto stream = static_cast<gpuStream_t>(stream_);
  PieceCursor cur(ranges, half_);
  std::vector<PieceCopy> copies;
  uint64_t len[2] = {0, 0};
  auto fill = [&](int b) -> bool {
    len[b] = cur.Next(&copies);
    for (const auto& c : copies)
      if (!GpuOk(gpuMemcpyAsync(buf_[b] + c.hostOffset, base + c.devOffset, c.size, gpuMemcpyDeviceToHost, stream),
                 "device-to-host copy", err))
        return false;
    return GpuOk(gpuEventRecord(static_cast<gpuEvent_t>(events_[b]), stream), "event record", err);
  };
  if (!fill(0)) return false;
  int b = 0;
  bool more = !cur.Done();
  if (more && !fill(1)) return false;
  while (len[b] > 0) {
    if (!GpuOk(gpuEventSynchronize(static_cast<gpuEvent_t>(events_[b])), "device-to-host copy", err)) return false;
    if (!sock.SendAll(buf_[b], len[b], timeoutMs, err)) return false;
    len[b] = 0;
    if (!cur.Done() && !fill(b)) return false;
    b ^= 1;
  }
  return true;
}

bool DeviceStager::RecvToDevice(net::Socket& sock, int device, uint8_t* base, const std::vector<ByteRange>& ranges,
                                int64_t timeoutMs, std::string* err) {
  DeviceGuard g(device);
  if (!Ensure(device, err)) return false;
  auto stream = static_cast<gpuStream_t>(stream_);
  PieceCursor cur(ranges, half_);
  std::vector<PieceCopy> copies;
  bool pending[2] = {false, false};
  int b = 0;
  while (!cur.Done()) {
    if (pending[b] && !GpuOk(gpuEventSynchronize(static_cast<gpuEvent_t>(events_[b])), "host-to-device copy", err))
      return false;
    uint64_t n = cur.Next(&copies);
    if (!sock.RecvAll(buf_[b], n, timeoutMs, err)) return false;
    for (const auto& c : copies)
      if (!GpuOk(gpuMemcpyAsync(base + c.devOffset, buf_[b] + c.hostOffset, c.size, gpuMemcpyHostToDevice, stream),
                 "host-to-device copy", err))
        return false;
    if (!GpuOk(gpuEventRecord(static_cast<gpuEvent_t>(events_[b]), stream), "event record", err)) return false;
    pending[b] = true;
    b ^= 1;
  }
  return GpuOk(gpuStreamSynchronize(stream), "host-to-device copy", err);
}

#endif

}  // namespace mori::io::tcp
