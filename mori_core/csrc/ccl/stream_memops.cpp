#include "ccl/stream_memops.hpp"

#if MORI_WITH_GPU
#include <cstring>

#include "common/error.hpp"

#if defined(MORI_GPU_CUDA)
#include <cuda.h>
#endif

namespace mori::ccl {

#if defined(MORI_GPU_CUDA)
namespace {
// The runtime API has no stream memory operations; the driver's are reached through the
// runtime's entry-point table (no link against libcuda).
using WaitFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using BatchFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

struct DriverOps {
  WaitFn wait = nullptr;
  WaitFn write = nullptr;
  BatchFn batch = nullptr;
  std::string why;
};

void* Lookup(const char* name, std::string& why) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || !p) {
    (void)cudaGetLastError();
    if (why.empty()) why = std::string("the CUDA driver does not provide ") + name;
    return nullptr;
  }
  return p;
}

const DriverOps& Ops() {
  static const DriverOps ops = [] {
    DriverOps d;
    d.wait = reinterpret_cast<WaitFn>(Lookup("cuStreamWaitValue32", d.why));
    d.write = reinterpret_cast<WaitFn>(Lookup("cuStreamWriteValue32", d.why));
    d.batch = reinterpret_cast<BatchFn>(Lookup("cuStreamBatchMemOp", d.why));
    return d;
  }();
  return ops;
}

void Check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    throw GpuError(std::string(what) + " failed (CUresult " + std::to_string(static_cast<int>(r)) + ")");
}
}  // namespace

const std::string& StreamMemOpsUnavailable() { return Ops().why; }

void SubmitMemOps(gpuStream_t stream, const MemOp* ops, int count, bool batch) {
  const DriverOps& d = Ops();
  if (!d.why.empty()) throw GpuError("stream memory operations: " + d.why);
  constexpr int kMaxBatch = 64;
  if (batch && count > 1) {
    CUstreamBatchMemOpParams p[kMaxBatch];
    for (int start = 0; start < count; start += kMaxBatch) {
      const int n = count - start < kMaxBatch ? count - start : kMaxBatch;
      for (int i = 0; i < n; ++i) {
        const MemOp& o = ops[start + i];
        std::memset(&p[i], 0, sizeof(p[i]));
        if (o.wait) {
          p[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
          p[i].waitValue.address = static_cast<CUdeviceptr>(o.addr);
          p[i].waitValue.value = o.value;
          p[i].waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
        } else {
          p[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
          p[i].writeValue.address = static_cast<CUdeviceptr>(o.addr);
          p[i].writeValue.value = o.value;
          p[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
        }
      }
      Check(d.batch(reinterpret_cast<CUstream>(stream), n, p, 0), "cuStreamBatchMemOp");
    }
    return;
  }
  for (int i = 0; i < count; ++i) {
    const MemOp& o = ops[i];
    if (o.wait)
      Check(d.wait(reinterpret_cast<CUstream>(stream), o.addr, o.value, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32");
    else
      Check(d.write(reinterpret_cast<CUstream>(stream), o.addr, o.value, CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue32");
  }
}

#else  // HIP: the runtime has the operations (no batched form in every ROCm release)

const std::string& StreamMemOpsUnavailable() {
  static const std::string none;
  return none;
}

void SubmitMemOps(gpuStream_t stream, const MemOp* ops, int count, bool /*batch*/) {
  for (int i = 0; i < count; ++i) {
    const MemOp& o = ops[i];
    void* p = reinterpret_cast<void*>(o.addr);
    if (o.wait)
      MORI_GPU_CHECK(hipStreamWaitValue32(stream, p, o.value, hipStreamWaitValueEq, 0xffffffffu));
    else
      MORI_GPU_CHECK(hipStreamWriteValue32(stream, p, o.value, 0));
  }
}
#endif

}  // namespace mori::ccl
#endif  // MORI_WITH_GPU
