// mori_core._C._xgmi_testing: the XGMI backend's scatter-copy kernel on a
// caller's stream, so the IO benchmark can time the kernel alone (CUDA events
// around it) beside the whole transfer, and sweep its shape; and copy-engine
// baselines of the same pieces. GPU builds only. Internal: not part of the
// public API.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "bindings/bindings.hpp"
#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "io/p2p/copy_proxy.hpp"
#include "io/p2p/scatter_copy.hpp"

namespace py = pybind11;
using namespace mori::io::p2p;

namespace mori::bindings {
namespace {

void CheckLengths(const char* fn, size_t a, size_t b, size_t c) {
  if (a != b || a != c) throw InvalidArgument(std::string(fn) + ": dsts, srcs and sizes must have the same length");
}

// One segment table per device for the benchmark's launches of more than
// kParamSegments segments. A timing loop launches the same segments in the
// same shape back to back (and replays graphs of them), so those launches may
// share the table: rewriting it with identical entries changes no byte an
// upload still queued on the stream reads. Anything else (other segments, a
// larger count, another piece size: other first pieces) is written only after
// the device went idle, since LaunchScatterTable's contract is that a table
// stays untouched until the launch that read it completed.
struct BenchTableSlot {
  std::unique_ptr<SegmentTable> table;
  size_t count = 0;
  uint32_t pieceBytes = 0;
};

SegmentTable& BenchTable(int device, const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
                         const std::vector<uint64_t>& sizes, uint32_t pieceBytes) {
  static std::mutex mu;
  static std::map<int, BenchTableSlot> slots;
  std::lock_guard<std::mutex> lock(mu);
  BenchTableSlot& slot = slots[device];
  const size_t count = dsts.size();
  bool same = slot.table && slot.count == count && slot.pieceBytes == pieceBytes;
  for (size_t i = 0; same && i < count; ++i) {
    const SegmentTable::Entry& e = slot.table->host()[i];
    same = e.src == srcs[i] && e.dst == dsts[i] && e.size == sizes[i];
  }
  if (same) return *slot.table;
  MORI_GPU_CHECK(gpuDeviceSynchronize());  // no queued upload reads the table below
  if (!slot.table || slot.table->capacity() < count) {
    slot.table.reset();
    size_t cap = 4096;
    while (cap < count) cap *= 2;
    slot.table = std::make_unique<SegmentTable>(device, cap);
  }
  SegmentTable::Entry* e = slot.table->host();
  for (size_t i = 0; i < count; ++i) e[i] = {srcs[i], dsts[i], sizes[i], 0, 0};
  slot.count = count;
  slot.pieceBytes = pieceBytes;
  return *slot.table;
}

}  // namespace

void RegisterXgmiTesting(py::module_& m) {
  py::module_ t = m.def_submodule("_xgmi_testing", "XGMI backend internals for the IO benchmark (not public API).");
  t.def(
      "scatter_copy",
      [](const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs, const std::vector<uint64_t>& sizes,
         uint64_t stream, uint32_t pieceBytes, uint32_t threads, uint32_t maxBlocks) {
        CheckLengths("scatter_copy", dsts.size(), srcs.size(), sizes.size());
        ScatterShape shape{pieceBytes, threads, maxBlocks};
        auto s = reinterpret_cast<gpuStream_t>(stream);
        py::gil_scoped_release nogil;
        if (dsts.size() <= kParamSegments) {
          std::vector<CopySeg> segs(dsts.size());
          for (size_t i = 0; i < segs.size(); ++i) segs[i] = {srcs[i], dsts[i], sizes[i]};
          LaunchScatterCopy(segs.data(), segs.size(), shape, KernelSignal{}, s);
          return;
        }
        int device = 0;
        MORI_GPU_CHECK(gpuGetDevice(&device));
        SegmentTable& table = BenchTable(device, dsts, srcs, sizes, pieceBytes);
        LaunchScatterTable(table, dsts.size(), shape, KernelSignal{}, s);
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("stream"), py::arg("piece_bytes") = 16384,
      py::arg("threads") = 256, py::arg("max_blocks") = 0,
      "Enqueue the scatter-copy kernel on `stream` (a cudaStream_t as int; its device must be current). More than "
      "64 segments go through a segment table shared by the calls on that device (same segments each time).");
  t.def(
      "copy_engine_pieces",
      [](const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs, const std::vector<uint64_t>& sizes,
         uint64_t stream, bool batched) {
        CheckLengths("copy_engine_pieces", dsts.size(), srcs.size(), sizes.size());
        auto s = reinterpret_cast<gpuStream_t>(stream);
        py::gil_scoped_release nogil;
        if (!batched) {
          for (size_t i = 0; i < dsts.size(); ++i)
            MORI_GPU_CHECK(gpuMemcpyAsync(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]),
                                          sizes[i], gpuMemcpyDefault, s));
          return;
        }
#if !defined(MORI_GPU_HIP) && defined(CUDART_VERSION) && CUDART_VERSION >= 13000
        std::vector<void*> d(dsts.size());
        std::vector<const void*> sr(srcs.size());
        std::vector<size_t> n(sizes.size());
        for (size_t i = 0; i < dsts.size(); ++i) {
          d[i] = reinterpret_cast<void*>(dsts[i]);
          sr[i] = reinterpret_cast<const void*>(srcs[i]);
          n[i] = sizes[i];
        }
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t attrIdx = 0;
        MORI_GPU_CHECK(cudaMemcpyBatchAsync(d.data(), sr.data(), n.data(), d.size(), &attr, &attrIdx, 1, s));
#else
        throw BadState("copy_engine_pieces(batched=True) needs cudaMemcpyBatchAsync (CUDA 13 runtime headers)");
#endif
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("stream"), py::arg("batched") = false,
      "Copy-engine baseline of a batch of pieces on `stream`: one cudaMemcpyAsync per piece, or (batched) one "
      "cudaMemcpyBatchAsync for all of them.");
  t.def(
      "enable_peer_access",
      [](int device, int peer) {
        DeviceGuard g(device);
        gpuError_t e = gpuDeviceEnablePeerAccess(peer, 0);
        if (e != gpuSuccess && e != gpuErrorPeerAccessAlreadyEnabled) MORI_GPU_CHECK(e);
        (void)gpuGetLastError();
      },
      py::arg("device"), py::arg("peer"), "Let kernels on `device` access memory of `peer`.");
  t.def("pinned_ping_pong_us", &PinnedPingPongUs, py::arg("device"), py::arg("iters"),
        py::call_guard<py::gil_scoped_release>(),
        "Host -> GPU -> host round trips through pinned memory (us each): the floor of the copy proxy's latency.");
}

}  // namespace mori::bindings
