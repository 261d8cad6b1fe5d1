// The network engine of the inter-node kernels: NVSHMEM, initialised through
// its unique-id bootstrap (the id travels over mori_core.shmem's bootstrap
// store). Plain C++ interface: NVSHMEM headers stay inside the .cu file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace mori::ep::inter::net {

// 128 opaque bytes created on one rank (its NVSHMEM bootstrap listens on them).
std::string UniqueId();
// Collective over `world` ranks; `device` becomes this thread's CUDA device.
// Throws mori::Error with NVSHMEM's status when initialisation fails.
void Init(int rank, int world, const std::string& uid, int device);
bool Initialized();
void Finalize();
int MyPe();
int NPes();
// Collective symmetric allocation on the NVSHMEM heap, zeroed; throws naming
// NVSHMEM_SYMMETRIC_SIZE when the heap is exhausted.
void* Malloc(size_t bytes);
void Free(void* p);
// Address of symmetric `p` on `pe` for loads/stores from this GPU, or null when
// `pe` is reachable only through NVSHMEM's transfers (nvshmem_ptr).
void* PeerPtr(void* p, int pe);
// Bring-up check of the engine: a put-with-signal of `bytes` to `peer` and a
// bounded wait for the signal of the PE that sends here (every PE calls it with
// the same offset peer - me); verifies the bytes received. Keys: ok,
// mismatches, signal_timeout, us (put + wait time on the device).
std::map<std::string, double> SelfTest(int peer, size_t bytes, int64_t timeout_ms);

}  // namespace mori::ep::inter::net
