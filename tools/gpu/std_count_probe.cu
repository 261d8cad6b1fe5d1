// Where the standard-MoE dispatch's count of "tokens before this block, per expert" spends its
// time (issue #31, round 11). In the EP4 x 128 profile that count takes ~0.8 us in the first
// blocks and ~4 us in the last (127 tokens x top-8 = 1016 ids, 8 per thread, loads issued
// together), far above one memory round trip. This standalone program runs the count alone on one
// GPU, one block per SM as the dispatch does (block b counts the ids of tokens [0, b)), in
// variants that drop one part at a time, and prints per-block durations (globaltimer, between
// two barriers) with the ids cached in L2 ("warm") and after a 256 MiB write evicted them
// ("cold").
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -I mori_core/csrc -DMORI_WITH_GPU=1 -DMORI_WITH_CUDA=1 \
//     -o /tmp/std_count_probe tools/gpu/std_count_probe.cu && /tmp/std_count_probe
//
// Variants (every one stores what it computed, so nothing is optimised away):
//   shuffle   the dispatch's own CountFirstEntries (ops/ep_std_layout.cuh): lane per entry, 8 loads
//             in flight, repeats of an expert within a token found by shuffles (unrolled for a
//             compile-time top-k since round 14), shared-memory atomicAdd per first entry
//             (round 13's count, whose shuffle loop was bounded by the runtime top-k, is this
//             variant in the probe at commit 240da95)
//   reload    round 10's version: repeats found by reloading the token's earlier ids
//   no_dedup  loads and shared-memory atomics, no repeat check
//   loads     the loads alone (XOR of the ids)
//   loads_v4  the loads alone, 16 bytes per lane
//   after_local_atomic / after_peer_atomic  shuffle, begun right after four threads of warp 0 issue
//             a returning system-scope atomicAdd (as the dispatch's slot reservation) on this GPU /
//             on GPU 1 over NVLink (peer variant only with two GPUs), its result used at the end:
//             does the count wait for that reply?
//   peer_atomic_rtt  that peer atomic alone, its reply awaited before the closing barrier (the
//             round trip the count would hide behind)
#include <cuda_runtime.h>

#include "ops/ep_std_layout.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kTopk = 8, kExperts = 256, kThreads = 128, kUnroll = 8;

__device__ __forceinline__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

enum Variant { kShuffle, kReload, kNoDedup, kLoads, kLoadsV4, kAfterLocal, kAfterPeer, kPeerRtt, kNumVariants };
const char* kNames[kNumVariants] = {"shuffle", "reload", "no_dedup", "loads", "loads_v4", "after_local_atomic",
                                    "after_peer_atomic", "peer_atomic_rtt"};

template <int V>
__global__ void __launch_bounds__(kThreads) CountKernel(mori::ep::EpKernelArgs a, const int32_t* ids, int32_t* out,
                                                        uint64_t* dur, int* counter) {
  __shared__ int32_t s_cnt[kExperts];
  const int tid = threadIdx.x, lane = tid & 31, T = blockDim.x;
  for (int e = tid; e < kExperts; e += T) s_cnt[e] = 0;
  __syncthreads();
  const uint64_t t0 = Now();
  const int entries = blockIdx.x * kTopk;  // tokens [0, b) of this rank
  int acc = 0;
  if constexpr (V == kAfterLocal || V == kAfterPeer || V == kPeerRtt) {
    if (tid < 4) acc = atomicAdd_system(counter + tid, 1);
  }
  if constexpr (V == kPeerRtt) {
    if (acc == -12345) s_cnt[0] = 1;  // waits for the reply
  } else if constexpr (V == kShuffle || V == kAfterLocal || V == kAfterPeer) {
    mori::ep::dev::CountFirstEntries(a, s_cnt, ids, blockIdx.x);
  } else if constexpr (V == kLoadsV4) {
    const int4* v = reinterpret_cast<const int4*>(ids);
    for (int i0 = tid; i0 < entries / 4; i0 += T * kUnroll) {
      int4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) x[u] = i0 + u * T < entries / 4 ? v[i0 + u * T] : make_int4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
  } else {
    for (int w0 = tid - lane; w0 < entries; w0 += T * kUnroll) {
      int ev[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = w0 + u * T + lane;
        ev[u] = i < entries ? ids[i] : -1;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (w0 + u * T >= entries) break;
        const int i = w0 + u * T + lane, e = ev[u], k = i % kTopk;
        if constexpr (V == kLoads) {
          acc ^= e;
        } else {
          bool first = true;
          if constexpr (V == kReload) {
            if (e >= 0) {
              for (int j = 0; j < k; ++j)
                if (ids[i - k + j] == e) {
                  first = false;
                  break;
                }
            }
          }
          if (e >= 0 && e < kExperts && first) atomicAdd(s_cnt + e, 1);
        }
      }
    }
  }
  __syncthreads();
  const uint64_t t1 = Now();
  if (tid == 0) dur[blockIdx.x] = t1 - t0;
  for (int e = tid; e < kExperts; e += T) out[blockIdx.x * kExperts + e] = s_cnt[e] ^ (e == 0 ? acc : 0);
}

int* g_local_counter = nullptr;
int* g_peer_counter = nullptr;  // on GPU 1, mapped for GPU 0

template <int V>
void Launch(int blocks, const int32_t* ids, int32_t* out, uint64_t* dur) {
  mori::ep::EpKernelArgs a{};  // CountFirstEntries reads the geometry's top-k and expert count only
  a.geo.topk = kTopk;
  a.geo.num_experts = kExperts;
  CountKernel<V><<<blocks, kThreads>>>(a, ids, out, dur,
                                       (V == kAfterPeer || V == kPeerRtt) ? g_peer_counter : g_local_counter);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int blocks = sms, tokens = blocks;  // block b counts tokens [0, b): the last counts sms - 1
  std::vector<int32_t> h_ids(static_cast<size_t>(tokens) * kTopk);
  std::srand(1);
  for (int t = 0; t < tokens; ++t) {  // top-8 distinct experts of 256, as the bench routes
    std::vector<int> perm(kExperts);
    for (int e = 0; e < kExperts; ++e) perm[e] = e;
    for (int k = 0; k < kTopk; ++k) std::swap(perm[k], perm[k + std::rand() % (kExperts - k)]);
    for (int k = 0; k < kTopk; ++k) h_ids[t * kTopk + k] = perm[k];
  }
  int32_t *ids, *out;
  uint64_t* dur;
  void* flush;
  const size_t flush_bytes = 256ull << 20;
  CHECK(cudaMalloc(&ids, h_ids.size() * sizeof(int32_t)));
  CHECK(cudaMalloc(&out, static_cast<size_t>(blocks) * kExperts * sizeof(int32_t)));
  CHECK(cudaMalloc(&dur, blocks * sizeof(uint64_t)));
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMemcpy(ids, h_ids.data(), h_ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&g_local_counter, 64));
  CHECK(cudaMemset(g_local_counter, 0, 64));
  int gpus = 0, can_peer = 0;
  CHECK(cudaGetDeviceCount(&gpus));
  if (gpus >= 2) CHECK(cudaDeviceCanAccessPeer(&can_peer, 0, 1));
  if (can_peer) {
    CHECK(cudaSetDevice(1));
    CHECK(cudaMalloc(&g_peer_counter, 64));
    CHECK(cudaMemset(g_peer_counter, 0, 64));
    CHECK(cudaSetDevice(0));
    CHECK(cudaDeviceEnablePeerAccess(1, 0));
  }
  void (*launch[kNumVariants])(int, const int32_t*, int32_t*, uint64_t*) = {
      Launch<kShuffle>, Launch<kReload>, Launch<kNoDedup>, Launch<kLoads>, Launch<kLoadsV4>,
      Launch<kAfterLocal>, Launch<kAfterPeer>, Launch<kPeerRtt>};
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs: block b counts the ids of tokens [0, b) (top-%d of %d), %d threads; per-block us\n\n",
              prop.name, sms, kTopk, kExperts, kThreads);
  std::printf("| variant | L2 | median block | p90 block | last block (%d tokens) | max block |\n|---|---|---|---|---|---|\n",
              blocks - 1);
  for (int v = 0; v < kNumVariants; ++v) {
    if ((v == kAfterPeer || v == kPeerRtt) && !g_peer_counter) {
      std::printf("| %s | - | no second GPU with peer access |\n", kNames[v]);
      continue;
    }
    for (int cold = 0; cold < 2; ++cold) {
      std::vector<double> med, p90, last, mx;
      for (int rep = 0; rep < 20; ++rep) {
        if (cold) CHECK(cudaMemset(flush, rep & 0xff, flush_bytes));
        else launch[v](blocks, ids, out, dur);  // the ids in L2 before the timed launch
        launch[v](blocks, ids, out, dur);
        CHECK(cudaDeviceSynchronize());
        std::vector<uint64_t> d(blocks);
        CHECK(cudaMemcpy(d.data(), dur, blocks * sizeof(uint64_t), cudaMemcpyDeviceToHost));
        last.push_back(d[blocks - 1] / 1e3);
        std::sort(d.begin(), d.end());
        med.push_back(d[blocks / 2] / 1e3);
        p90.push_back(d[(blocks * 9) / 10] / 1e3);
        mx.push_back(d[blocks - 1] / 1e3);
      }
      auto median = [](std::vector<double> x) {
        std::sort(x.begin(), x.end());
        return x[x.size() / 2];
      };
      std::printf("| %s | %s | %.2f | %.2f | %.2f | %.2f |\n", kNames[v], cold ? "cold" : "warm", median(med),
                  median(p90), median(last), median(mx));
    }
  }
  // The counts of the last block must match the host's (the shuffle variant is the dispatch's).
  launch[kShuffle](blocks, ids, out, dur);
  std::vector<int32_t> got(kExperts);
  CHECK(cudaMemcpy(got.data(), out + static_cast<size_t>(blocks - 1) * kExperts, kExperts * sizeof(int32_t),
                   cudaMemcpyDeviceToHost));
  std::vector<int32_t> want(kExperts, 0);
  for (int i = 0; i < (blocks - 1) * kTopk; ++i) want[h_ids[i]] += 1;
  const bool ok = got == want;
  std::printf("\nshuffle variant's counts of the last block %s the host's\n", ok ? "equal" : "DIFFER FROM");
  return ok ? 0 : 1;
}
