// EpHandle: the buffers and sync state of one IntraNode EP operator, and the
// checked launch of its dispatch/combine kernels (config, error record and
// buffer table: EpHandleBase). Tensors arrive as raw device pointers from the
// Python layer (no libtorch).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "ops/ep_handle_base.hpp"
#include "ops/ep_kernels.hpp"
#include "ops/ep_types.hpp"

namespace mori::ep {

// Raised by a launch when an earlier kernel of the operator reported a failure
// (the op is unusable afterwards); the bindings map it to its own Python type
// so the Python layer can re-raise it as EpOpError without a per-call check.
class OpFailed : public BadState {
 public:
  using BadState::BadState;
};

using EpHandleConfig = EpOpConfig;

// Tokens per chunk of the staged push combine (MORI_EP_PUSH_STAGE_TOKENS overrides it per op);
// 0 = never staged. The 4xH100 sweep (bench ep --tune, EP4 x 4096 tokens, docs/ep.md) had the
// unstaged push ahead of every chunk size: BF16 609 us unstaged vs 623-677 us staged, FP8 direct
// cast 396-429 us vs 632-2022 us (512-token chunks, the old default: 1055 us).
constexpr int kDefaultPushStageTokens = 0;
// Overlapped push combine (MORI_EP_PUSH_OVERLAP=auto, the default): on for rounds whose
// dispatched tokens, all ranks together, reach this. Small batches keep the push-barrier-reduce
// kernel (1.5-2x ahead of DeepEP there); at EP4 x 4096 its separate reduce pass (~120 of ~590 us)
// is what the overlap hides behind the transfer.
constexpr int kDefaultPushOverlapTokens = 8192;
// A pull call whose round is small (every source dispatched at most this many tokens) runs the
// push algorithm on the registered rows (MORI_EP_PULL_PUSH_TOKENS overrides it per op; 0 = never).
// 4xH100, kernel alone (CUDA graph), EP4: 128 tokens 32.2 us pushed against 36.8-38.0 pulled;
// 512 tokens 87.8 against 82.1-83.4 (docs/ep.md, issue #31 round 7). EP2: even at 128 tokens.
constexpr int kDefaultPullPushTokens = 256;
// A dispatch launched with at least this many warps (blocks x warps per block) copies
// (token, slice, destination) items, one destination rank per warp, instead of storing each
// slice to all its destinations from one warp (MORI_EP_DISPATCH_PER_DEST_WARPS overrides it per
// op; -1 = never, 0 = always). 4xH100 EP4, kernel alone (CUDA graph), bf16 / fp8: at 132x16
// (vLLM's default grid) 27.8 / 20.9 us against 36.6 / 26.2 at 128 tokens, 72.7 / 45.5 against
// 104 / 59.4 at 512, 467 / 253 against 563 / 317 at 4096; it loses only on small grids at 4096
// tokens (96x4: 486 against 469; 64x4: 511 against 477), see docs/ep.md (issue #31, round 8).
constexpr int kDefaultPerDestWarps = 512;
// Warps per block of the standard-MoE expand kernel.
constexpr int kStdExpandWarps = 8;

class EpHandle : public EpHandleBase {
 public:
  // Allocates all buffers from the symmetric heap (collective: every rank must
  // create its handles in the same order) and zeroes them.
  explicit EpHandle(const EpHandleConfig& cfg);
  ~EpHandle() override;

  void Dispatch(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales, uintptr_t indices,
                int blocks, int warps, uintptr_t stream);
  // `mode`: EpCombineMode (0 pull: rows from the registered buffers; 1 push: `input` rows to their
  // sources; 2 copy-pull: `input` rows copied into this rank's registered buffer, then pull).
  void Combine(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights, int weight_rows,
               uintptr_t indices, int num_tokens, int mode, int blocks, int warps,
               uintptr_t stream);

  // name -> (device pointer, bytes) of the buffers Python views.
  BufferTable Buffers() const;

  // ---- FP8 combine, standard-MoE layout, profiler (issue #15) ----
  // Transport quantisation of every later combine (EpCombineQuant: 0 none,
  // 1 fp8_direct_cast, 2 fp8_blockwise); FP8 needs bf16 rows.
  void SetCombineQuant(int quant);
  int combine_quant() const { return combine_quant_; }
  // Allocates the standard-MoE buffers on first use (collective, like the
  // constructor: every rank in the same order) and returns their heap offset.
  uint64_t EnsureStandardMoe();
  // dispatch_standard_moe: a dispatch whose rows carry their 3-D positions (ranked by the dispatch
  // kernel, or by a plan kernel before it with MORI_EP_STD_FUSED=0), then the local expand (a
  // kernel, or the dispatch kernel's tail with MORI_EP_STD_FUSED=2).
  void DispatchStandardMoe(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales,
                           uintptr_t indices, int blocks, int warps, uintptr_t stream);
  // convert_dispatch_output: received 2-D rows (x_rows rows) + their top-k ids -> 3-D layout.
  void ConvertDispatchOutput(uintptr_t x, int row_bytes, int x_rows, uintptr_t ids, int blocks, int warps,
                             uintptr_t stream);
  // convert_combine_input: 3-D expert outputs -> registered combine input (weighted per token).
  void ConvertCombineInput(uintptr_t packed, int dtype, int hidden_dim, int blocks, int warps, uintptr_t stream);
  // combine_standard_moe: weighted sum of each received token's expert rows pushed to its source, then combine.
  void CombineStandardMoe(uintptr_t packed, int dtype, int hidden_dim, uintptr_t indices, int num_tokens, int blocks,
                          int warps, uintptr_t stream);
  // name -> (device pointer, bytes) of the standard-MoE buffers (empty before EnsureStandardMoe).
  BufferTable StandardMoeBuffers() const;
  // (device pointer, bytes) of the profiler's event buffer; (0, 0) unless built with MORI_ENABLE_PROFILER.
  std::pair<uintptr_t, size_t> DebugTimeBuf() const;
  // Clears the profiler's events (no-op without the profiler).
  void ResetDebugTimeBuf();
  static bool ProfilerEnabled();
  uint64_t HeapOffset() const { return heap_offset_; }
  int sm_count() const { return sm_count_; }
  int arch_major() const { return arch_major_; }
  // Frees the buffers (collective, like construction). Idempotent.
  void Close();

 private:
  // Throws BadState when closed or shmem was finalised, OpFailed when a kernel
  // of this op reported a failure. Runs before every launch; costs two loads.
  void CheckUsable() const;
  void CheckWarps(int warps, int max_threads, const char* what) const;
  DispatchParams CheckedDispatchParams(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights,
                                       uintptr_t scales, uintptr_t indices, int blocks, int warps) const;
  // Validates a combine launch; returns its row bytes.
  int CheckedCombineRowBytes(int dtype, int hidden_dim, int num_tokens, uintptr_t indices, int blocks, int warps) const;
  // block_num clamped to what fits co-resident for this combine variant.
  int CombineGrid(int dtype, bool push, bool standard_moe, int warps, int blocks);
  void RequireStandardMoe() const;
  // Staged- and overlapped-push fields of a push combine launch of `blocks` blocks.
  void SetPushStaging(CombineParams& p, int blocks) const;
  const char* PhaseName(int phase) const override;

  int device_ = -1;
  int sm_count_ = 0;
  int arch_major_ = 0;
  uint64_t generation_ = 0;
  uint8_t* block_ = nullptr;  // one heap allocation holding every buffer
  uint64_t heap_offset_ = 0;
  uint64_t block_bytes_ = 0;
  EpKernelArgs args_{};
  std::map<std::tuple<int, bool, int, int, bool>, int> combine_grid_cap_;
  int combine_quant_ = 0;
  int push_stage_tokens_ = kDefaultPushStageTokens;
  int push_reduce_blocks_ = -1;
  int32_t std_mode_ = kStdFused;  // EpStdMode of dispatch_standard_moe (MORI_EP_STD_FUSED)
  std::map<int, int> std_grid_cap_;  // warps -> co-resident blocks of the one-launch dispatch
  int push_overlap_tokens_ = kDefaultPushOverlapTokens;  // -1: never overlapped
  int push_overlap_reduce_blocks_ = 0;
  int pull_push_tokens_ = kDefaultPullPushTokens;  // 0: pull calls always pull
  int per_dest_min_warps_ = kDefaultPerDestWarps;  // -1: never, 0: always
  uint8_t* std_block_ = nullptr;  // standard-MoE buffers (allocated on first use)
  uint64_t std_offset_ = 0;
  uint64_t std_bytes_ = 0;
  int64_t* prof_events_ = nullptr;  // profiler builds only
  int32_t* prof_cursor_ = nullptr;
};

}  // namespace mori::ep
