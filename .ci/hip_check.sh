#!/usr/bin/env bash
# Compile-check the HIP (AMD) build of the shmem layer and the EP kernels with
# Debian's hipcc (ROCm 5.2, clang backend) for gfx90a. No AMD GPU is needed:
# this proves the same sources compile for HIP; it runs nothing.
#
#   bash .ci/hip_check.sh            (installs Debian's hipcc with apt when missing and run as root)
#   HIP_ARCH=gfx942 bash .ci/hip_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${HIP_ARCH:-gfx90a}
if ! command -v hipcc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y --no-install-recommends hipcc >/dev/null
  else
    echo "hip_check: hipcc not found (apt-get install hipcc on Debian 12)"; exit 2
  fi
fi
# Debian's hipcc picks the NVIDIA platform when nvcc is on PATH; force AMD.
export HIP_PLATFORM=amd HIP_COMPILER=clang HIP_RUNTIME=rocclr
OUTDIR=$(mktemp -d)
trap 'rm -rf "$OUTDIR"' EXIT
FLAGS=(-std=c++17 -O2 -Wall -Wno-unused-parameter -DMORI_WITH_GPU=1 -DMORI_WITH_HIP=1 -I mori_core/csrc)
status=0
for f in mori_core/csrc/ops/ep_dispatch.cu mori_core/csrc/ops/ep_combine.cu mori_core/csrc/ops/ep_combine_bf16.cu mori_core/csrc/ops/ep_combine_fp32.cu mori_core/csrc/ops/ep_launch_probe.cu \
         mori_core/csrc/ops/ep_combine_fp8.cu mori_core/csrc/ops/ep_combine_std.cu mori_core/csrc/ops/ep_standard_moe.cu \
         mori_core/csrc/io/p2p/scatter_copy.cu mori_core/csrc/io/p2p/copy_proxy.cu \
         mori_core/csrc/ccl/ccl_kernels.cu mori_core/csrc/ccl/ccl_reduce_f32.cu mori_core/csrc/ccl/ccl_reduce_f16.cu \
         mori_core/csrc/ccl/ccl_reduce_bf16.cu mori_core/csrc/ccl/ccl_reduce_i32.cu mori_core/csrc/ccl/link_probe.cu; do
  echo "hipcc --offload-arch=$ARCH $f"
  hipcc -x hip --offload-arch="$ARCH" "${FLAGS[@]}" -c "$f" -o "$OUTDIR/$(basename "$f").o" || status=1
done
for f in mori_core/csrc/ops/ep_handle_base.cpp mori_core/csrc/ops/ep_handle.cpp mori_core/csrc/shmem/symmetric_heap.cpp \
         mori_core/csrc/shmem/shmem_state.cpp mori_core/csrc/shmem/heap_allocator.cpp \
         mori_core/csrc/common/gpu_runtime.cpp mori_core/csrc/io/p2p/ipc_cache.cpp \
         mori_core/csrc/io/p2p/stream_pool.cpp mori_core/csrc/io/p2p/signal_slots.cpp mori_core/csrc/io/p2p/completion_waiter.cpp \
         mori_core/csrc/io/p2p/xgmi_backend.cpp mori_core/csrc/io/tcp/gpu_staging.cpp \
         mori_core/csrc/ccl/ccl_handle.cpp mori_core/csrc/ccl/ce_collectives.cpp mori_core/csrc/ccl/ce_watchdog.cpp \
         mori_core/csrc/ccl/stream_memops.cpp; do
  echo "hipcc (host) $f"
  hipcc -x hip --offload-arch="$ARCH" "${FLAGS[@]}" -c "$f" -o "$OUTDIR/$(basename "$f").o" || status=1
done
[ $status = 0 ] && echo "hip_check: OK ($ARCH)" || echo "hip_check: FAILED"
exit $status
