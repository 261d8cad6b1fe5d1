// The SM data-movement kernels of MORI-CCL: all-gather and all-to-all (stage the input in
// this rank's heap, one barrier, pull every peer's part), the close barrier, and the
// dispatch of every SM collective (the all-reduce kernels are in ccl_reduce.cuh).
//
// Buffers that peers read or write hold two copies chosen by the epoch's parity: a peer
// that signalled epoch e has finished epoch e-1, so when this rank starts epoch e+1 nobody
// still uses the copy of epoch e-1 it overwrites. One barrier per call is then enough.
//
// Only what peers read is staged before the barrier; the rank's own chunk (input -> its slot
// of the output) is copied after the pulls, where its HBM traffic overlaps the other blocks'
// NVLink pulls instead of lengthening the staging phase every peer waits for (round 1 on
// 4x H100: staging was ~1/6 of a 256 MiB all-gather / all-to-all). The input must then stay
// unchanged until the call (or wait_async) completes, as with NCCL.
#include "ccl/ccl_device.cuh"
#include "ccl/ccl_kernels.hpp"
#include "ccl/ccl_reduce_launch.hpp"

namespace mori::ccl {
namespace {

using namespace mori::ccl::dev;

template <typename V>
__global__ void AllGatherKernel(SmSync s, SmArgs a, int phase) {
  const uint32_t e = CallEpoch(s);
  const uint64_t par = (e & 1u) ? a.buf_parity : 0;
  uint64_t b0, b1;
  BlockRange(a.nbytes / sizeof(V), b0, b1);
  const V* in = reinterpret_cast<const V*>(a.in);
  if (phase & kPhaseStart) CopyRange(reinterpret_cast<V*>(a.buf + par), in, b0, b1);
  const bool ok = Barrier(s, 0, e, phase & kPhaseStart, phase & kPhaseFinish, kSiteStaged);
  if (phase & kPhaseFinish) {
    if (ok) {
      for (int i = 0; i < s.npes - 1; ++i) {
        const int p = PeerAt(s, i);
        CopyRange(reinterpret_cast<V*>(a.out + p * a.nbytes), reinterpret_cast<const V*>(a.peer_buf[p] + par), b0, b1);
      }
    }
    V* own = reinterpret_cast<V*>(a.out + s.rank * a.nbytes);
    if (own != in) CopyRange(own, in, b0, b1);  // also after a timeout: this rank's part is known
    AdvanceEpoch(s, e);
  }
}

template <typename V>
__global__ void AllToAllKernel(SmSync s, SmArgs a, int phase) {
  const uint32_t e = CallEpoch(s);
  const uint64_t par = (e & 1u) ? a.buf_parity : 0;
  uint64_t b0, b1;
  BlockRange(a.nbytes / sizeof(V), b0, b1);
  if (phase & kPhaseStart) {
    for (int i = 0; i < s.npes - 1; ++i) {  // the chunks peers pull, in the order they pull them
      const int p = PeerAt(s, i);
      CopyRange(reinterpret_cast<V*>(a.buf + par + p * a.nbytes), reinterpret_cast<const V*>(a.in + p * a.nbytes), b0, b1);
    }
  }
  const bool ok = Barrier(s, 0, e, phase & kPhaseStart, phase & kPhaseFinish, kSiteStaged);
  if (phase & kPhaseFinish) {
    if (ok) {
      for (int i = 0; i < s.npes - 1; ++i) {
        const int p = PeerAt(s, i);
        CopyRange(reinterpret_cast<V*>(a.out + p * a.nbytes),
                  reinterpret_cast<const V*>(a.peer_buf[p] + par + s.rank * a.nbytes), b0, b1);
      }
    }
    CopyRange(reinterpret_cast<V*>(a.out + s.rank * a.nbytes), reinterpret_cast<const V*>(a.in + s.rank * a.nbytes),
              b0, b1);
    AdvanceEpoch(s, e);
  }
}

__global__ void CloseKernel(SmSync s, const uint32_t* ce_freed) {
  const uint32_t e = CallEpoch(s);
  const bool ok = Barrier(s, 0, e, true, true, kSiteClose);
  const int p = static_cast<int>(threadIdx.x);
  if (ok && ce_freed && p < s.npes && p != s.rank) {
    const uint64_t start = GlobalTimerNs();
    while (LoadAcquireSys(ce_freed + p) != 1u) {
      if (GlobalTimerNs() - start > s.timeout_ns) {
        ReportTimeout(s, p, e, kSiteClose);
        break;
      }
    }
  }
  AdvanceEpoch(s, e);
}

template <typename V>
void LaunchCopyKernel(bool gather, const SmSync& s, const SmArgs& a, int phase, dim3 g, dim3 b, gpuStream_t st) {
  if (gather)
    AllGatherKernel<V><<<g, b, 0, st>>>(s, a, phase);
  else
    AllToAllKernel<V><<<g, b, 0, st>>>(s, a, phase);
}

}  // namespace

void LaunchSmCollective(Path path, RedType red, const SmSync& s, const SmArgs& a, int phase, int blocks, int threads,
                        gpuStream_t st) {
  const dim3 g(blocks), b(threads);
  if (path == Path::kSmAllGather || path == Path::kSmAllToAll) {
    const uintptr_t bits = reinterpret_cast<uintptr_t>(a.in) | reinterpret_cast<uintptr_t>(a.out) | a.nbytes;
    const bool gather = path == Path::kSmAllGather;
    if (bits % 16 == 0)
      LaunchCopyKernel<int4>(gather, s, a, phase, g, b, st);
    else if (bits % 4 == 0)
      LaunchCopyKernel<uint32_t>(gather, s, a, phase, g, b, st);
    else
      LaunchCopyKernel<uint8_t>(gather, s, a, phase, g, b, st);
  } else {
    ReduceLaunch l{};
    l.path = path;
    l.sync = &s;
    l.args = &a;
    l.phase = phase;
    l.grid = g;
    l.block = b;
    l.stream = st;
    LaunchReduce(red, l);
  }
  MORI_GPU_CHECK(gpuGetLastError());
}

void LaunchCeReduce(RedType red, const CeReduceArgs& a, int blocks, int threads, gpuStream_t st) {
  ReduceLaunch l{};
  l.ce = &a;
  l.npes = a.npes;
  l.grid = dim3(blocks);
  l.block = dim3(threads);
  l.stream = st;
  LaunchReduce(red, l);
  MORI_GPU_CHECK(gpuGetLastError());
}

void LaunchClose(const SmSync& s, const uint32_t* ce_freed, gpuStream_t st) {
  CloseKernel<<<1, 32, 0, st>>>(s, ce_freed);
  MORI_GPU_CHECK(gpuGetLastError());
}

}  // namespace mori::ccl
