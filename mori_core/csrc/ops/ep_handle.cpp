#include "ops/ep_handle.hpp"

#include <algorithm>
#include <cstdlib>

#include "common/error.hpp"
#include "ops/ep_profiler_phases.hpp"
#include "shmem/gpu_ext.hpp"
#include "shmem/shmem_state.hpp"

namespace mori::ep {

namespace {

void Require(bool cond, const std::string& msg) { RequireArg(cond, msg); }

// Per-launch checks build their message only when they fail: a launch is on
// the host's hot path (a few microseconds in all), string building is not.
#define EP_CHECK_ARG(cond, msg_expr)                    \
  do {                                                  \
    if (!(cond)) throw ::mori::InvalidArgument(msg_expr); \
  } while (0)

using Layout = BufferLayout;

// Offsets of the op's buffers inside its heap block.
Layout MakeLayout(const EpHandleConfig& c, size_t row_cap) {
  const size_t tok = c.max_num_inp_token_per_rank, k = c.num_experts_per_token;
  Layout l;
  AddReceiveBuffers(l, c, row_cap);
  l.Add("stage", static_cast<size_t>(c.world_size) * tok * row_cap);
  l.Add("stage_weights", static_cast<size_t>(c.world_size) * tok * k * 4);
  l.Add("recv_counter", 2 * sizeof(int32_t));
  l.Add("dispatch_flags", kMaxWorld * sizeof(uint32_t));
  l.Add("combine_flags", kMaxWorld * sizeof(uint32_t));
  l.Add("combine_out", tok * row_cap);
  l.Add("combine_out_weights", tok * k * 4);
  l.Add("dest_slot", tok * c.world_size * 4);
  l.Add("token_mask", tok * 4);
  l.Add("sync", sizeof(EpSyncState));
  l.Add("std_counts", 2 * static_cast<size_t>(c.world_size) * c.world_size * c.num_experts_per_rank * sizeof(int32_t));
  l.Add("std_flags", kMaxWorld * sizeof(uint32_t));
  l.Add("peer_tokens", 2 * kMaxWorld * sizeof(int32_t));
  l.Add("push_flags", static_cast<size_t>(kMaxPushStages) * kMaxWorld * sizeof(uint32_t));
  l.Add("push_rows", static_cast<size_t>(c.world_size) * tok * sizeof(uint32_t));
  l.Finish();
  return l;
}

// Staged push combine (CombineParams::stage_tokens / reduce_blocks) from the environment, read
// once per op: MORI_EP_PUSH_STAGE_TOKENS (tokens per chunk; 0 = never staged; every rank must use
// the same value) and MORI_EP_PUSH_REDUCE_BLOCKS (blocks that only reduce; -1 = a quarter of the grid).
// Overlapped push (CombineParams::overlap_*): MORI_EP_PUSH_OVERLAP (0 never, 1 always, auto from
// kDefaultPushOverlapTokens dispatched tokens per round; the same on every rank) and
// MORI_EP_PUSH_OVERLAP_REDUCE_BLOCKS (blocks that only reduce; 0, the default = every block
// once it has pushed).
int EnvInt(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  Require(end && *end == '\0' && x >= lo && x <= hi,
          std::string(name) + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
              v + "'");
  return static_cast<int>(x);
}

// MORI_EP_PUSH_OVERLAP: the CombineParams::overlap_tokens threshold.
int EnvOverlapTokens() {
  const char* v = std::getenv("MORI_EP_PUSH_OVERLAP");
  const std::string s = v ? v : "";
  if (s.empty() || s == "auto") return kDefaultPushOverlapTokens;
  Require(s == "0" || s == "1", "MORI_EP_PUSH_OVERLAP must be 0, 1 or auto, got '" + s + "'");
  return s == "1" ? 0 : -1;
}

int TokenWords(const EpHandleConfig& c) { return (c.max_num_inp_token_per_rank + 31) / 32; }

// Standard-MoE buffers (a second heap block, allocated on first use).
Layout MakeStdLayout(const EpHandleConfig& c, size_t row_cap) {
  const size_t el = c.num_experts_per_rank, tpe = static_cast<size_t>(c.world_size) * c.max_num_inp_token_per_rank;
  const size_t ne = el * c.world_size, words = TokenWords(c), k = c.num_experts_per_token;
  const size_t scale_bytes = static_cast<size_t>(c.scale_dim) * c.scale_type_size;
  Layout l;
  l.Add("packed_x", el * tpe * row_cap);
  l.Add("packed_scales", el * tpe * scale_bytes);
  l.Add("packed_src_info", el * tpe * 4);
  l.Add("std_row", static_cast<size_t>(c.max_num_tokens_to_recv) * k * 4);
  l.Add("std_rel", static_cast<size_t>(c.max_num_tokens_to_recv) * k * 4);
  l.Add("packed_count", el * 4);
  l.Add("layout_range", el * c.world_size * 8);
  l.Add("plan_bits", 2 * ne * words * 4);
  l.Add("plan_prefix", ne * words * 4);
  l.Add("conv_bits", el * c.world_size * words * 4);
  l.Add("conv_prefix", el * c.world_size * words * 4);
  l.Finish();
  return l;
}

}  // namespace

const char* EpHandle::PhaseName(int phase) const { return phase == kPhaseDispatch ? "dispatch" : "combine"; }

EpHandle::EpHandle(const EpHandleConfig& c) : EpHandleBase(c, kMaxWorld, KernelWarpSize(), "") {
  shmem::SymmetricHeap& heap = shmem::Heap();
  Require(heap.world_size() == c.world_size && heap.rank() == c.rank,
          "config rank/world_size (" + std::to_string(c.rank) + "/" + std::to_string(c.world_size) +
              ") differ from shmem's (" + std::to_string(heap.rank()) + "/" + std::to_string(heap.world_size()) + ")");
  device_ = heap.device();
  generation_ = shmem::Generation();
  DeviceGuard guard(device_);
  MORI_GPU_CHECK(gpuDeviceGetAttribute(&sm_count_, gpuDevAttrMultiProcessorCount, device_));
  MORI_GPU_CHECK(gpuDeviceGetAttribute(&arch_major_, gpuDevAttrComputeCapabilityMajor, device_));

  const Layout layout = MakeLayout(c, row_cap_);
  block_bytes_ = layout.total;
  block_ = static_cast<uint8_t*>(heap.Malloc(block_bytes_, 4096));
  heap_offset_ = static_cast<uint64_t>(block_ - heap.base());
  MORI_GPU_CHECK(gpuMemset(block_, 0, block_bytes_));
  EpErrorRecord* dev_error = OpenErrorRecord();

  EpGeometry& g = args_.geo;
  FillCommonGeometry(g, c);
  BindTimeout(&g.timeout_ns);
  auto at = [&](const char* name) { return block_ + layout.Off(name); };
  EpBuffers& b = args_.buf;
  BindCommonBuffers(b, at, dev_error);
  b.stage = at("stage");
  b.stage_weights = reinterpret_cast<float*>(at("stage_weights"));
  b.dest_slot = reinterpret_cast<int32_t*>(at("dest_slot"));
  b.token_mask = reinterpret_cast<uint32_t*>(at("token_mask"));
  b.std_counts = reinterpret_cast<int32_t*>(at("std_counts"));
  b.std_flags = reinterpret_cast<uint32_t*>(at("std_flags"));
  b.peer_tokens = reinterpret_cast<int32_t*>(at("peer_tokens"));
  b.push_flags = reinterpret_cast<uint32_t*>(at("push_flags"));
  b.push_rows = reinterpret_cast<uint32_t*>(at("push_rows"));
  push_stage_tokens_ = EnvInt("MORI_EP_PUSH_STAGE_TOKENS", kDefaultPushStageTokens, 0, 1 << 30);
  push_reduce_blocks_ = EnvInt("MORI_EP_PUSH_REDUCE_BLOCKS", -1, -1, 1 << 20);
  // dispatch_standard_moe ranks its rows inside the dispatch kernel (MORI_EP_STD_FUSED=1, the
  // default: dispatch + expand kernel; 2: one launch, the expand as the dispatch kernel's tail) or
  // with the plan kernel before it (0: three launches); the same on every rank (the paths send
  // the per-expert counts differently). The fused kernels keep one count per expert in shared
  // memory: with too many experts for the largest block they fall back to 0, from the config
  // alone (so every rank picks the same path).
  static constexpr int32_t kStdModes[] = {kStdPlanned, kStdFused, kStdOneLaunch};
  std_mode_ = kStdModes[EnvInt("MORI_EP_STD_FUSED", 1, 0, 2)];
  if (DispatchSmemBytes(kDispatchMaxThreads, kMaxWorld, std_mode_, c.world_size * c.num_experts_per_rank,
                        c.num_experts_per_token) > kDispatchMaxSmem)
    std_mode_ = kStdPlanned;
  push_overlap_tokens_ = EnvOverlapTokens();
  push_overlap_reduce_blocks_ = EnvInt("MORI_EP_PUSH_OVERLAP_REDUCE_BLOCKS", 0, -1, 1 << 20);
  pull_push_tokens_ = EnvInt("MORI_EP_PULL_PUSH_TOKENS", kDefaultPullPushTokens, 0, 1 << 30);
  per_dest_min_warps_ = EnvInt("MORI_EP_DISPATCH_PER_DEST_WARPS", kDefaultPerDestWarps, -1, 1 << 30);
  g.tpe = c.world_size * c.max_num_inp_token_per_rank;
  g.tok_words = TokenWords(c);
#if MORI_ENABLE_PROFILER
  const size_t prof_bytes = sizeof(int64_t) * 2 * static_cast<size_t>(kProfMaxWarps) * kProfEventsPerWarp;
  MORI_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&prof_events_), prof_bytes));
  MORI_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&prof_cursor_), sizeof(int32_t) * kProfMaxWarps));
  MORI_GPU_CHECK(gpuMemset(prof_events_, 0, prof_bytes));
  MORI_GPU_CHECK(gpuMemset(prof_cursor_, 0, sizeof(int32_t) * kProfMaxWarps));
  b.prof_events = prof_events_;
  b.prof_cursor = prof_cursor_;
#endif
  for (int pe = 0; pe < kMaxWorld; ++pe)
    args_.peer_delta[pe] = pe < c.world_size ? static_cast<int64_t>(heap.PeerBase(pe) - heap.base()) : 0;
}

EpHandle::~EpHandle() {
  try {
    Close();
  } catch (...) {
  }
}

void EpHandle::Close() {
  if (block_ && shmem::Initialized() && shmem::Generation() == generation_) {
    DeviceGuard guard(device_);
    (void)gpuDeviceSynchronize();
    if (std_block_) shmem::Heap().Free(std_block_);
    shmem::Heap().Free(block_);
  }
  block_ = nullptr;
  std_block_ = nullptr;
  args_.std = EpStdBuffers{};
  if (prof_events_ || prof_cursor_) {
    DeviceGuard guard(device_);
    if (prof_events_) (void)gpuFree(prof_events_);
    if (prof_cursor_) (void)gpuFree(prof_cursor_);
    prof_events_ = nullptr;
    prof_cursor_ = nullptr;
  }
  CloseErrorRecord();
}

void EpHandle::CheckUsable() const {
  if (!block_) throw BadState("the EP operator is closed");
  if (shmem::Generation() != generation_ || !shmem::Initialized())
    throw BadState("mori shmem was finalised after this EP operator was created; recreate the operator");
  if (Failed()) throw OpFailed(ErrorMessage());
}

void EpHandle::CheckWarps(int warps, int max_threads, const char* what) const {
  const int max_warps = max_threads / KernelWarpSize();
  EP_CHECK_ARG(warps >= 1 && warps <= max_warps, std::string(what) + " warp_per_block must be in [1, " +
                                                     std::to_string(max_warps) + "], got " + std::to_string(warps));
}

DispatchParams EpHandle::CheckedDispatchParams(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights,
                                               uintptr_t scales, uintptr_t indices, int blocks, int warps) const {
  CheckUsable();
  CheckDispatchRows(input, row_bytes, num_tokens, indices);
  // each block's share of a round's arrival units must be positive (kArriveShift)
  EP_CHECK_ARG(blocks >= 1 && blocks <= kMaxArriveBlocks, "dispatch block_num must be in [1, " +
                                                              std::to_string(kMaxArriveBlocks) + "], got " +
                                                              std::to_string(blocks));
  CheckWarps(warps, kDispatchMaxThreads, "dispatch");
  DispatchParams p{};
  FillDispatchPointers(p, cfg_, input, row_bytes, num_tokens, weights, scales, indices);
  p.per_dest = per_dest_min_warps_ >= 0 && blocks * warps >= per_dest_min_warps_ ? 1 : 0;
  return p;
}

void EpHandle::Dispatch(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights, uintptr_t scales,
                        uintptr_t indices, int blocks, int warps, uintptr_t stream) {
  const DispatchParams p = CheckedDispatchParams(input, row_bytes, num_tokens, weights, scales, indices, blocks, warps);
  DeviceGuard guard(device_);
  LaunchDispatch(args_, p, blocks, warps, reinterpret_cast<gpuStream_t>(stream));
}

int EpHandle::CheckedCombineRowBytes(int dtype, int hidden_dim, int num_tokens, uintptr_t indices, int blocks,
                                     int warps) const {
  CheckUsable();
  const int row_bytes = CheckCombineRows(dtype, hidden_dim, num_tokens, indices);
  EP_CHECK_ARG(blocks >= 1, "block_num must be >= 1, got " + std::to_string(blocks));
  CheckWarps(warps, kCombineMaxThreads, "combine");
  if (combine_quant_ != kQuantNone) {
    EP_CHECK_ARG(dtype == 0, "FP8 combine (quant_type fp8_*) carries bf16 rows; got fp32 combine input");
    EP_CHECK_ARG(combine_quant_ != kQuantFp8Block || hidden_dim % kFp8BlockElems == 0,
                 "quant_type fp8_blockwise needs a hidden size that is a multiple of " +
                     std::to_string(kFp8BlockElems) + ", got " + std::to_string(hidden_dim));
  }
  return row_bytes;
}

int EpHandle::CombineGrid(int dtype, bool push, bool standard_moe, int warps, int blocks) {
  const CombineDtype dt = dtype == 0 ? CombineDtype::kBf16 : CombineDtype::kFp32;
  auto key = std::make_tuple(dtype, push, warps, combine_quant_, standard_moe);
  auto it = combine_grid_cap_.find(key);
  if (it == combine_grid_cap_.end())
    it = combine_grid_cap_
             .emplace(key, CombineMaxCoResidentBlocks(cfg_.world_size, dt, push, combine_quant_, standard_moe, warps,
                                                      device_))
             .first;
  return std::min(blocks, std::max(1, it->second));
}

void EpHandle::Combine(uintptr_t input, int dtype, int hidden_dim, int input_rows, uintptr_t weights, int weight_rows,
                       uintptr_t indices, int num_tokens, int mode, int blocks, int warps, uintptr_t stream) {
  const int row_bytes = CheckedCombineRowBytes(dtype, hidden_dim, num_tokens, indices, blocks, warps);
  EP_CHECK_ARG(mode >= kCombinePull && mode <= kCombinePullOrPush,
               "combine mode must be 0 (pull), 1 (push), 2 (copy, then pull) or 3 (pull, push when small), got " +
                   std::to_string(mode));
  const bool push = mode == kCombinePush, reads_input = mode == kCombinePush || mode == kCombineCopyPull;
  EP_CHECK_ARG(!reads_input || input % 16 == 0, "input must be 16-byte aligned");
  blocks = CombineGrid(dtype, push, false, warps, blocks);
  CombineParams p{};
  p.input = reinterpret_cast<const uint8_t*>(input);
  p.weights = reinterpret_cast<const float*>(weights);
  p.indices = reinterpret_cast<const int32_t*>(indices);
  p.row_bytes = row_bytes;
  p.input_rows = input_rows;
  p.weight_rows = weight_rows;
  // Peers write this rank's dispatch outputs in their next dispatch, which may start before this
  // rank's reduce ends: rows or weights that live there are staged first (a local copy).
  const auto inside = [](uintptr_t p, const void* base, size_t bytes) {
    const auto b = reinterpret_cast<uintptr_t>(base);
    return p >= b && p < b + bytes;
  };
  const size_t recv = static_cast<size_t>(cfg_.max_num_tokens_to_recv);
  p.stage_own = (inside(input, args_.buf.dispatch_out, recv * row_cap_) ||
                 inside(weights, args_.buf.dispatch_out_weights, recv * cfg_.num_experts_per_token * sizeof(float)))
                    ? 1
                    : 0;
  p.num_tokens = num_tokens;
  p.check_input_rows = reads_input ? 1 : 0;
  p.quant = combine_quant_;
  p.copy_input = mode == kCombineCopyPull ? 1 : 0;
  p.pull_push_tokens = mode == kCombinePullOrPush ? pull_push_tokens_ : 0;
  // A pull call's rows are in the registered buffer, whatever `input` is (dtype and size only);
  // the small rounds that push read them there.
  if (mode == kCombinePullOrPush) p.input = args_.buf.combine_inp;
  SetPushStaging(p, blocks);
  DeviceGuard guard(device_);
  LaunchCombine(args_, p, dtype == 0 ? CombineDtype::kBf16 : CombineDtype::kFp32, push, blocks, warps,
                reinterpret_cast<gpuStream_t>(stream));
}

void EpHandle::SetPushStaging(CombineParams& p, int blocks) const {
  p.stage_tokens = push_stage_tokens_;
  // Reducers keep up with the pushers at a quarter of the grid: they move the local rows (HBM)
  // while the pushers are bound by the links.
  p.reduce_blocks = push_reduce_blocks_ >= 0 ? std::min(push_reduce_blocks_, blocks - 1) : blocks / 4;
  // Whether a round overlaps is decided on the device from every rank's token count; the kernel
  // that reduces while the rows arrive is this rank's guess of it from its own count (either
  // kernel takes part in an overlapped round). By default every block reduces once it has pushed
  // (0): the sweep on 4xH100 (EP4 x 4096) had 533 us BF16 / 383 us FP8 for it, 544 / 524 with
  // half the grid only reducing (-1), 582-635 with 33 or 88 reducer blocks.
  p.overlap_tokens = push_overlap_tokens_;
  p.overlap_reduce_blocks =
      push_overlap_reduce_blocks_ >= 0 ? std::min(push_overlap_reduce_blocks_, blocks - 1) : blocks / 2;
  p.overlap_kernel = push_overlap_tokens_ >= 0 && push_stage_tokens_ == 0 &&
                             static_cast<int64_t>(p.num_tokens) * cfg_.world_size >= push_overlap_tokens_
                         ? 1
                         : 0;
}

BufferTable EpHandle::Buffers() const {
  if (!block_) throw BadState("the EP operator is closed");
  return OutputBuffers(MakeLayout(cfg_, row_cap_), block_, args_.buf.sync);
}

// ---------------------------------------------------------------------------------------------
// FP8 combine, standard-MoE layout, profiler (issue #15)

void EpHandle::SetCombineQuant(int quant) {
  Require(quant == kQuantNone || quant == kQuantFp8Cast || quant == kQuantFp8Block,
          "combine quant code must be 0 (none), 1 (fp8_direct_cast) or 2 (fp8_blockwise), got " + std::to_string(quant));
  combine_quant_ = quant;
}

uint64_t EpHandle::EnsureStandardMoe() {
  CheckUsable();
  // The plan and expand kernels keep one int per expert (of all ranks) in shared memory.
  Require(static_cast<size_t>(args_.geo.num_experts) * sizeof(int32_t) <= 48 * 1024,
          "the standard-MoE layout supports at most " + std::to_string(48 * 1024 / sizeof(int32_t)) +
              " experts in total (world_size x num_experts_per_rank), got " + std::to_string(args_.geo.num_experts));
  if (!std_block_) {
    const Layout l = MakeStdLayout(cfg_, row_cap_);
    shmem::SymmetricHeap& heap = shmem::Heap();
    std_block_ = static_cast<uint8_t*>(heap.Malloc(l.total, 4096));
    std_bytes_ = l.total;
    std_offset_ = static_cast<uint64_t>(std_block_ - heap.base());
    DeviceGuard guard(device_);
    MORI_GPU_CHECK(gpuMemset(std_block_, 0, std_bytes_));
    auto at = [&](const char* name) { return std_block_ + l.Off(name); };
    EpStdBuffers& b = args_.std;
    b.packed_x = at("packed_x");
    b.packed_scales = at("packed_scales");
    b.packed_src_info = reinterpret_cast<int32_t*>(at("packed_src_info"));
    b.std_row = reinterpret_cast<int32_t*>(at("std_row"));
    b.std_rel = reinterpret_cast<int32_t*>(at("std_rel"));
    b.packed_count = reinterpret_cast<int32_t*>(at("packed_count"));
    b.layout_range = reinterpret_cast<int64_t*>(at("layout_range"));
    b.plan_bits = reinterpret_cast<uint32_t*>(at("plan_bits"));
    b.plan_prefix = reinterpret_cast<int32_t*>(at("plan_prefix"));
    b.conv_bits = reinterpret_cast<uint32_t*>(at("conv_bits"));
    b.conv_prefix = reinterpret_cast<int32_t*>(at("conv_prefix"));
  }
  return std_offset_;
}

void EpHandle::RequireStandardMoe() const {
  CheckUsable();
  if (!std_block_) throw BadState("the standard-MoE buffers are not allocated (EnsureStandardMoe first)");
}

void EpHandle::DispatchStandardMoe(uintptr_t input, int row_bytes, int num_tokens, uintptr_t weights,
                                   uintptr_t scales, uintptr_t indices, int blocks, int warps, uintptr_t stream) {
  RequireStandardMoe();
  DispatchParams p = CheckedDispatchParams(input, row_bytes, num_tokens, weights, scales, indices, blocks, warps);
  p.standard_moe = std_mode_;
  const size_t smem = DispatchSmemBytes(warps * KernelWarpSize(), cfg_.world_size <= 2 ? 2 : (cfg_.world_size <= 4 ? 4 : 8),
                                        p.standard_moe, args_.geo.num_experts, cfg_.num_experts_per_token);
  Require(smem <= kDispatchMaxSmem, "dispatch_standard_moe needs " + std::to_string(smem) +
                                        " bytes of shared memory per block at warp_per_block=" + std::to_string(warps) +
                                        " (at most " + std::to_string(kDispatchMaxSmem) + "); use fewer warps per block");
  DeviceGuard guard(device_);
  const gpuStream_t s = reinterpret_cast<gpuStream_t>(stream);
  if (std_mode_ == kStdOneLaunch) {
    // The tail copies with about the expand kernel's warps; the extra blocks send nothing. All
    // blocks wait for block 0 before the tail, so the grid must be co-resident.
    auto it = std_grid_cap_.find(warps);
    if (it == std_grid_cap_.end())
      it = std_grid_cap_
               .emplace(warps, DispatchMaxCoResidentBlocks(cfg_.world_size, kStdOneLaunch, args_.geo.num_experts,
                                                           cfg_.num_experts_per_token, warps, device_))
               .first;
    const int grid = std::max(1, std::min(it->second, std::max(blocks, sm_count_ * kStdExpandWarps / warps)));
    p.send_blocks = std::min(blocks, grid);
    LaunchDispatch(args_, p, grid, warps, s);
    return;
  }
  if (std_mode_ == kStdPlanned) {
    const int plan_blocks = std::max(
        1, std::min(sm_count_, (num_tokens * cfg_.num_experts_per_token + kStdPlanThreads - 1) / kStdPlanThreads));
    LaunchStdPlan(args_, p.indices, num_tokens, plan_blocks, s);
  }
  LaunchDispatch(args_, p, blocks, warps, s);
  // One warp per received row and its local experts' copies; rows are known only on the device.
  LaunchStdExpand(args_, row_bytes, std_mode_ == kStdPlanned, sm_count_, kStdExpandWarps, s);
}

void EpHandle::ConvertDispatchOutput(uintptr_t x, int row_bytes, int x_rows, uintptr_t ids, int blocks, int warps,
                                     uintptr_t stream) {
  RequireStandardMoe();
  Require(row_bytes > 0 && row_bytes % 16 == 0 && row_bytes <= row_cap_,
          "dispatch_out_x rows must be a positive multiple of 16 bytes up to " + std::to_string(row_cap_) + ", got " +
              std::to_string(row_bytes));
  Require(x % 16 == 0 && x && ids, "dispatch_out_x and dispatch_out_topk_idx must be non-null, x 16-byte aligned");
  Require(x_rows >= 0, "dispatch_out_x rows must be >= 0");
  Require(blocks >= 1, "block_num must be >= 1, got " + std::to_string(blocks));
  CheckWarps(warps, kDispatchMaxThreads, "convert_dispatch_output");
  DeviceGuard guard(device_);
  LaunchConvertDispatch(args_, reinterpret_cast<const uint8_t*>(x), row_bytes, x_rows,
                        reinterpret_cast<const int32_t*>(ids), blocks, warps, reinterpret_cast<gpuStream_t>(stream));
}

void EpHandle::ConvertCombineInput(uintptr_t packed, int dtype, int hidden_dim, int blocks, int warps,
                                   uintptr_t stream) {
  RequireStandardMoe();
  Require(dtype == 0 || dtype == 1, "packed_recv_x dtype code must be 0 (bf16) or 1 (fp32)");
  const int row_bytes = hidden_dim * (dtype == 0 ? 2 : 4);
  Require(hidden_dim > 0 && row_bytes % 16 == 0 && row_bytes <= row_cap_,
          "packed_recv_x rows must be a positive multiple of 16 bytes up to " + std::to_string(row_cap_) + ", got " +
              std::to_string(row_bytes));
  Require(packed % 16 == 0 && packed, "packed_recv_x must be non-null and 16-byte aligned");
  Require(blocks >= 1, "block_num must be >= 1, got " + std::to_string(blocks));
  CheckWarps(warps, kCombineMaxThreads, "convert_combine_input");
  DeviceGuard guard(device_);
  LaunchConvertCombine(args_, reinterpret_cast<const uint8_t*>(packed), row_bytes,
                       dtype == 0 ? CombineDtype::kBf16 : CombineDtype::kFp32, blocks, warps,
                       reinterpret_cast<gpuStream_t>(stream));
}

void EpHandle::CombineStandardMoe(uintptr_t packed, int dtype, int hidden_dim, uintptr_t indices, int num_tokens,
                                  int blocks, int warps, uintptr_t stream) {
  RequireStandardMoe();
  const int row_bytes = CheckedCombineRowBytes(dtype, hidden_dim, num_tokens, indices, blocks, warps);
  Require(packed % 16 == 0 && packed, "combine_standard_moe input must be non-null and 16-byte aligned");
  blocks = CombineGrid(dtype, true, true, warps, blocks);
  CombineParams p{};
  p.input = reinterpret_cast<const uint8_t*>(packed);
  p.indices = reinterpret_cast<const int32_t*>(indices);
  p.row_bytes = row_bytes;
  p.num_tokens = num_tokens;
  p.quant = combine_quant_;
  p.standard_moe = 1;
  SetPushStaging(p, blocks);
  DeviceGuard guard(device_);
  LaunchCombine(args_, p, dtype == 0 ? CombineDtype::kBf16 : CombineDtype::kFp32, true, blocks, warps,
                reinterpret_cast<gpuStream_t>(stream));
}

BufferTable EpHandle::StandardMoeBuffers() const {
  if (!block_) throw BadState("the EP operator is closed");
  BufferTable out;
  if (!std_block_) return out;
  const Layout l = MakeStdLayout(cfg_, row_cap_);
  for (const char* name : {"packed_x", "packed_scales", "packed_src_info", "packed_count", "layout_range"}) {
    const auto& [off, bytes] = l.parts.at(name);
    out.emplace_back(name, reinterpret_cast<uintptr_t>(std_block_ + off), bytes);
  }
  return out;
}

bool EpHandle::ProfilerEnabled() { return MORI_ENABLE_PROFILER != 0; }

std::pair<uintptr_t, size_t> EpHandle::DebugTimeBuf() const {
  if (!block_) throw BadState("the EP operator is closed");
  if (!prof_events_) return {0, 0};
  return {reinterpret_cast<uintptr_t>(prof_events_),
          sizeof(int64_t) * 2 * static_cast<size_t>(kProfMaxWarps) * kProfEventsPerWarp};
}

void EpHandle::ResetDebugTimeBuf() {
  if (!block_) throw BadState("the EP operator is closed");
  if (!prof_events_) return;
  DeviceGuard guard(device_);
  MORI_GPU_CHECK(gpuDeviceSynchronize());
  MORI_GPU_CHECK(gpuMemset(prof_events_, 0, DebugTimeBuf().second));
  MORI_GPU_CHECK(gpuMemset(prof_cursor_, 0, sizeof(int32_t) * kProfMaxWarps));
}

}  // namespace mori::ep
