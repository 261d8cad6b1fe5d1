// The copy-engine collectives of CclHandle. Bytes move with cudaMemcpyAsync (copy
// engines) between the user's buffers and IPC-mapped heap buffers; ranks synchronise with
// stream memory operations on flags in each other's heaps. Every call forks the caller's
// stream into a main stream (staging, flag waits) and one stream per peer (its copy), so the
// per-peer copies run on several copy engines at once; wait_async / the end of a call joins
// them back. Flag protocol (all flags 0/1, the waiter resets):
//   ready[p]  in this rank's heap: peer p's data for this call is staged (all-gather,
//             all-to-all) or pushed into this rank's slot (all-reduce reduce-scatter);
//   ready2[p] all-reduce: peer p's reduced shard is ready to pull;
//   freed[p]  peer p finished reading this rank's buffers of the previous call (waited for
//             lazily at the start of the next call, so a call does not end with a barrier).
#include "ccl/ccl_handle.hpp"

#if MORI_WITH_GPU
#include <algorithm>

#include "ccl/ccl_kernels.hpp"
#include "ccl/stream_memops.hpp"
#include "common/error.hpp"

namespace mori::ccl {

void CclHandle::CeCopy(gpuStream_t s, void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0 || dst == src) return;
  MORI_GPU_CHECK(gpuMemcpyAsync(dst, src, bytes, gpuMemcpyDefault, s));
}

void CclHandle::CePeerCopy(int p, gpuStream_t t, void* dst, const void* src, uint64_t bytes) {
  const uint64_t min_piece = std::max<uint64_t>(opt_.ce_piece_min_bytes, 1);
  const uint64_t pieces = std::min<uint64_t>(static_cast<uint64_t>(opt_.ce_split), std::max<uint64_t>(bytes / min_piece, 1));
  if (pieces <= 1 || dst == src) return CeCopy(t, dst, src, bytes);
  // Piece 0 stays on t; pieces 1.. run on p's piece streams, forked from t here and joined
  // back into t (so whatever t enqueues next, e.g. the peer's signal, follows every piece).
  const uint64_t piece = ((bytes + pieces - 1) / pieces + 255) & ~uint64_t{255};  // 256-byte aligned pieces
  const int extra = opt_.ce_split - 1;
  MORI_GPU_CHECK(gpuEventRecord(piece_fork_ev_[p], t));
  int used = 0;
  for (uint64_t j = 1; j < pieces && j * piece < bytes; ++j) {
    const uint64_t off = j * piece;
    const int i = p * extra + static_cast<int>(j) - 1;
    gpuStream_t ps = piece_streams_[i];
    MORI_GPU_CHECK(gpuStreamWaitEvent(ps, piece_fork_ev_[p], 0));
    CeCopy(ps, static_cast<uint8_t*>(dst) + off, static_cast<const uint8_t*>(src) + off, std::min(piece, bytes - off));
    MORI_GPU_CHECK(gpuEventRecord(piece_join_ev_[i], ps));
    ++used;
  }
  CeCopy(t, dst, src, std::min(piece, bytes));
  for (int j = 0; j < used; ++j) MORI_GPU_CHECK(gpuStreamWaitEvent(t, piece_join_ev_[p * extra + j], 0));
}

void CclHandle::CeSignal(gpuStream_t s, const std::vector<std::pair<uint32_t*, uint32_t>>& writes) {
  if (writes.empty()) return;
  if (opt_.ce_signal_copy) {  // a 4-byte copy from the constant word holding the value
    for (const auto& w : writes)
      MORI_GPU_CHECK(gpuMemcpyAsync(w.first, ce_consts_ + w.second, 4, gpuMemcpyDefault, s));
    return;
  }
  MemOp ops[kMaxPeers];
  int n = 0;
  for (const auto& w : writes) ops[n++] = MemOp{false, reinterpret_cast<uint64_t>(w.first), w.second};
  SubmitMemOps(s, ops, n, opt_.ce_batch);
}

void CclHandle::CeWait(gpuStream_t s, int site, uint32_t* flags, const std::vector<int>& peers) {
  if (peers.empty()) return;
  MemOp ops[2 * kMaxPeers + 2];
  int n = 0;
  const uint64_t busy = reinterpret_cast<uint64_t>(busy_dev_ + site);
  ops[n++] = MemOp{false, busy, 1u};  // the watchdog bounds the wait while this word is set
  for (int p : peers) ops[n++] = MemOp{true, reinterpret_cast<uint64_t>(flags + p), 1u};
  for (int p : peers) ops[n++] = MemOp{false, reinterpret_cast<uint64_t>(flags + p), 0u};
  ops[n++] = MemOp{false, busy, 0u};
  SubmitMemOps(s, ops, n, opt_.ce_batch);
}

void CclHandle::CeStart(Path path, uintptr_t in_addr, uintptr_t out_addr, uint64_t nbytes, gpuStream_t s) {
  const uint8_t* in = reinterpret_cast<const uint8_t*>(in_addr);
  uint8_t* out = reinterpret_cast<uint8_t*>(out_addr);
  gpuStream_t main = streams_[npes_];
  MORI_GPU_CHECK(gpuEventRecord(fork_ev_, s));
  for (gpuStream_t t : streams_) MORI_GPU_CHECK(gpuStreamWaitEvent(t, fork_ev_, 0));
  std::vector<int> others;
  for (int p = 0; p < npes_; ++p)
    if (p != rank_) others.push_back(p);
  auto to_peer = [&](uint32_t* flags, int p) { return std::make_pair(ce_peer(flags, p) + rank_, 1u); };

  // Lazy exit barrier of the previous call: every peer finished reading this rank's heap buffers.
  CeWait(main, 0, ce_freed_, others);

  if (path == Path::kCeAllGather || path == Path::kCeAllToAll) {
    const bool gather = path == Path::kCeAllGather;
    if (gather) {
      CeCopy(main, ce_buf_.local, in, nbytes);
      std::vector<std::pair<uint32_t*, uint32_t>> w;
      for (int p : others) w.push_back(to_peer(ce_ready_, p));
      CeSignal(main, w);
    } else {
      for (int i = 1; i < npes_; ++i) {  // stage each peer's chunk, then tell that peer at once
        const int p = (rank_ + i) % npes_;
        CeCopy(main, ce_buf_.local + p * nbytes, in + p * nbytes, nbytes);
        CeSignal(main, {to_peer(ce_ready_, p)});
      }
    }
    // The own chunk after the staging, which every peer waits for (as in the SM kernels).
    MORI_GPU_CHECK(gpuEventRecord(fork_main_ev_, main));
    MORI_GPU_CHECK(gpuStreamWaitEvent(streams_[rank_], fork_main_ev_, 0));
    CeCopy(streams_[rank_], out + rank_ * nbytes, in + (gather ? 0 : rank_ * nbytes), nbytes);
    for (int p : others) {
      gpuStream_t t = streams_[p];
      CeWait(t, 1 + p, ce_ready_, {p});
      CePeerCopy(p, t, out + p * nbytes, ce_buf_.peer[p] + (gather ? 0 : rank_ * nbytes), nbytes);
      CeSignal(t, {to_peer(ce_freed_, p)});
    }
    return;
  }

  // All-reduce: reduce-scatter pushed by the copy engines, a local reduce, all-gather pulled.
  const uint64_t count = nbytes / esize_;
  const uint64_t shard = ShardElems(count);
  auto shard_len = [&](int p) -> uint64_t {
    const uint64_t b = static_cast<uint64_t>(p) * shard;
    return b >= count ? 0 : std::min(shard, count - b);
  };
  // After the freed wait: every peer's slot of this rank is free again.
  MORI_GPU_CHECK(gpuEventRecord(fork_main_ev_, main));
  for (int p : others) {
    gpuStream_t t = streams_[p];
    MORI_GPU_CHECK(gpuStreamWaitEvent(t, fork_main_ev_, 0));
    CePeerCopy(p, t, ce_buf_.peer[p] + rank_ * ce_slot_bytes_, in + p * shard * esize_, shard_len(p) * esize_);
    CeSignal(t, {to_peer(ce_ready_, p)});
  }
  for (int p : others) CeWait(main, 1 + p, ce_ready_, {p});
  CeReduceArgs a{};
  a.in = in;
  a.out = out;
  a.red = ce_red_.local;
  a.slots = ce_buf_.local;
  a.slot_bytes = ce_slot_bytes_;
  a.shard = shard;
  a.len = shard_len(rank_);
  a.rank = rank_;
  a.npes = npes_;
  const uint64_t units = a.len * esize_ / 16 + 1;
  const int max_blocks = opt_.reduce_blocks > 0 ? opt_.reduce_blocks : 2 * sm_count_;
  const int blocks =
      static_cast<int>(std::min<uint64_t>(std::max<uint64_t>((units + opt_.sm_threads - 1) / opt_.sm_threads, 1), max_blocks));
  LaunchCeReduce(red_, a, blocks, opt_.sm_threads, main);
  std::vector<std::pair<uint32_t*, uint32_t>> w;
  for (int p : others) w.push_back(to_peer(ce_ready2_, p));
  CeSignal(main, w);
  MORI_GPU_CHECK(gpuEventRecord(fork_main_ev_, main));
  for (int p : others) {
    gpuStream_t t = streams_[p];
    MORI_GPU_CHECK(gpuStreamWaitEvent(t, fork_main_ev_, 0));
    CeWait(t, 1 + npes_ + p, ce_ready2_, {p});
    CePeerCopy(p, t, out + p * shard * esize_, ce_red_.peer[p], shard_len(p) * esize_);
    CeSignal(t, {to_peer(ce_freed_, p)});
  }
}

void CclHandle::CeFinish(gpuStream_t s) {
  for (size_t i = 0; i < streams_.size(); ++i) {
    MORI_GPU_CHECK(gpuEventRecord(join_ev_[i], streams_[i]));
    MORI_GPU_CHECK(gpuStreamWaitEvent(s, join_ev_[i], 0));
  }
}

}  // namespace mori::ccl
#endif  // MORI_WITH_GPU
