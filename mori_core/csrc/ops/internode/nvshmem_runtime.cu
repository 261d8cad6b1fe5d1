#include "ops/internode/nvshmem_runtime.hpp"

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>

#include "common/error.hpp"
#include "common/gpu_runtime.hpp"
#include "ops/internode/internode_device.cuh"

namespace mori::ep::inter::net {

namespace {
bool g_initialized = false;
int g_device = -1;

__global__ void SelfTestKernel(uint8_t* dst, const uint8_t* src, size_t bytes, uint64_t* sig, int peer,
                               uint64_t timeout_ns, uint8_t expect_seed, int64_t* out) {
  // out: [0] mismatches, [1] signal timed out, [2] elapsed ns
  const uint64_t t0 = mori::ep::dev::GlobalTimerNs();
  if (threadIdx.x < 32) nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, 1, NVSHMEM_SIGNAL_SET, peer);
  __syncthreads();
  __shared__ int timed_out;
  if (threadIdx.x == 0) {
    timed_out = 0;
    while (mori::ep::inter::dev::LoadAcquireSys64(sig) != 1) {
      if (mori::ep::dev::GlobalTimerNs() - t0 > timeout_ns) {
        timed_out = 1;
        break;
      }
    }
  }
  __syncthreads();
  long long bad = 0;
  if (!timed_out)
    for (size_t i = threadIdx.x; i < bytes; i += blockDim.x)
      if (dst[i] != static_cast<uint8_t>(expect_seed + i * 7)) ++bad;
  atomicAdd(reinterpret_cast<unsigned long long*>(&out[0]), static_cast<unsigned long long>(bad));
  __syncthreads();
  if (threadIdx.x == 0) {
    nvshmem_quiet();
    out[1] = timed_out;
    out[2] = static_cast<int64_t>(mori::ep::dev::GlobalTimerNs() - t0);
  }
}

__global__ void FillKernel(uint8_t* p, size_t bytes, uint8_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += gridDim.x * blockDim.x)
    p[i] = static_cast<uint8_t>(seed + i * 7);
}

void Check(int status, const char* what) {
  if (status != 0) throw Error(std::string("NVSHMEM ") + what + " failed with status " + std::to_string(status));
}
}  // namespace

std::string UniqueId() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  Check(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void Init(int rank, int world, const std::string& uid, int device) {
  if (g_initialized) throw BadState("NVSHMEM is already initialised in this process");
  if (uid.size() != sizeof(nvshmemx_uniqueid_t))
    throw InvalidArgument("NVSHMEM unique id must be " + std::to_string(sizeof(nvshmemx_uniqueid_t)) + " bytes, got " +
                          std::to_string(uid.size()));
  MORI_GPU_CHECK(cudaSetDevice(device));
  MORI_GPU_CHECK(cudaFree(nullptr));  // make the primary context current for NVSHMEM's driver calls
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  Check(nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr), "nvshmemx_set_attr_uniqueid_args");
  // nvshmemx_init_attr() exits the process on failure; call what it wraps to report instead.
  int provided = 0;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  const int status =
      nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  if (status != 0)
    throw Error("NVSHMEM initialisation (unique-id bootstrap, rank " + std::to_string(rank) + " of " +
                std::to_string(world) + ") failed with status " + std::to_string(status) +
                "; run with NVSHMEM_DEBUG=INFO for the transport NVSHMEM tried");
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world)
    throw Error("NVSHMEM came up as PE " + std::to_string(nvshmem_my_pe()) + " of " + std::to_string(nvshmem_n_pes()) +
                ", expected " + std::to_string(rank) + " of " + std::to_string(world));
  g_initialized = true;
  g_device = device;
}

bool Initialized() { return g_initialized; }

void Finalize() {
  if (!g_initialized) return;
  (void)cudaSetDevice(g_device);
  (void)cudaDeviceSynchronize();
  nvshmem_finalize();
  g_initialized = false;
}

int MyPe() { return g_initialized ? nvshmem_my_pe() : -1; }
int NPes() { return g_initialized ? nvshmem_n_pes() : 0; }

void* Malloc(size_t bytes) {
  if (!g_initialized) throw BadState("NVSHMEM is not initialised");
  MORI_GPU_CHECK(cudaSetDevice(g_device));
  void* p = nvshmem_malloc(bytes);
  if (!p)
    throw Error("nvshmem_malloc of " + std::to_string(bytes >> 20) +
                " MiB failed: raise NVSHMEM_SYMMETRIC_SIZE (same value on every rank) or lower "
                "max_num_inp_token_per_rank / hidden_dim");
  MORI_GPU_CHECK(cudaMemset(p, 0, bytes));
  MORI_GPU_CHECK(cudaDeviceSynchronize());
  return p;
}

void Free(void* p) {
  if (!g_initialized || !p) return;
  (void)cudaSetDevice(g_device);
  (void)cudaDeviceSynchronize();
  nvshmem_free(p);
}

void* PeerPtr(void* p, int pe) {
  if (!g_initialized) throw BadState("NVSHMEM is not initialised");
  if (pe < 0 || pe >= nvshmem_n_pes()) throw InvalidArgument("PE " + std::to_string(pe) + " out of range");
  return nvshmem_ptr(p, pe);
}

std::map<std::string, double> SelfTest(int peer, size_t bytes, int64_t timeout_ms) {
  if (!g_initialized) throw BadState("NVSHMEM is not initialised");
  if (peer < 0 || peer >= nvshmem_n_pes()) throw InvalidArgument("self-test peer out of range");
  MORI_GPU_CHECK(cudaSetDevice(g_device));
  const size_t padded = (bytes + 255) / 256 * 256;
  auto* buf = static_cast<uint8_t*>(Malloc(2 * padded + 256));
  uint8_t* src = buf;
  uint8_t* dst = buf + padded;
  auto* sig = reinterpret_cast<uint64_t*>(buf + 2 * padded);
  int64_t* out = nullptr;
  MORI_GPU_CHECK(cudaMalloc(&out, 3 * sizeof(int64_t)));
  MORI_GPU_CHECK(cudaMemset(out, 0, 3 * sizeof(int64_t)));
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  // Every PE sends to the PE at the same offset, so this one receives from the PE that far behind
  // it (the same PE as `peer` only with 2 PEs).
  const int from = ((2 * me - peer) % n + n) % n;
  FillKernel<<<64, 256>>>(src, bytes, static_cast<uint8_t>(me * 31 + 1));
  MORI_GPU_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();  // every PE filled its source before any put
  SelfTestKernel<<<1, 256>>>(dst, src, bytes, sig, peer, static_cast<uint64_t>(timeout_ms) * 1000000ull,
                              static_cast<uint8_t>(from * 31 + 1), out);
  MORI_GPU_CHECK(cudaGetLastError());
  MORI_GPU_CHECK(cudaDeviceSynchronize());
  int64_t h[3];
  MORI_GPU_CHECK(cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost));
  (void)cudaFree(out);
  nvshmem_barrier_all();
  Free(buf);
  return {{"ok", (h[0] == 0 && h[1] == 0) ? 1.0 : 0.0},
          {"mismatches", static_cast<double>(h[0])},
          {"signal_timeout", static_cast<double>(h[1])},
          {"us", static_cast<double>(h[2]) / 1000.0}};
}

}  // namespace mori::ep::inter::net
