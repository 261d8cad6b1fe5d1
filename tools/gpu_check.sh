#!/usr/bin/env bash
# Build mori-suite on the GPU machine and run the GPU tests and benchmarks.
#
#   bash tools/gpu_check.sh [section ...]      (default: every tools/gpu/*.sh)
#
# Each section is tools/gpu/<name>.sh (io, ep, vllm, omni). Logs and result
# tables go to $OUT (the device tool fetches that folder); a summary table of
# the sections is printed last. Always runs with NVLink multicast disabled.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"

# Runtime wheels the image lacks (pyzmq, msgspec), carried in .whl/.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
# DeepEP (a same-run baseline for the EP sections) builds in the background while the suite
# builds; sections wait for /tmp/deepep/ok or /tmp/deepep/failed. MORI_GPU_DEEPEP=0 skips it.
if [ "${MORI_GPU_DEEPEP:-1}" = 1 ] && [ -f .baselines/DeepEP-1.2.1.tar.gz ] && [ ! -f /tmp/deepep/ok ]; then
  MAX_JOBS=$(( $(nproc) / 2 )) nohup bash tools/gpu/deepep_build.sh /tmp/deepep > "$OUT/deepep_build.txt" 2>&1 &
fi
t0=$(date +%s)
# MORI_GPU_SKIP_BUILD=1 reuses the suite a previous call installed on this (still warm) machine.
if [ "${MORI_GPU_SKIP_BUILD:-0}" = 1 ] && python3 -c "import mori_core._C" 2>/dev/null; then
  echo "build: skipped (MORI_GPU_SKIP_BUILD=1, installed suite reused)"
else
  if ! CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) MORI_CUDA_ARCH=${MORI_CUDA_ARCH:-90} python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1; then
    tail -50 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
  echo "build: $(( $(date +%s) - t0 )) s"
fi
python3 -c "import mori_core; print('build info', mori_core.build_info())"
export MORI_GPU_CHECK_BUILT=1

sections=("$@")
if [ ${#sections[@]} -eq 0 ]; then
  for f in tools/gpu/*.sh; do sections+=("$(basename "$f" .sh)"); done
fi
declare -A status seconds
for s in "${sections[@]}"; do
  t=$(date +%s)
  echo "=== section $s ==="
  if bash "tools/gpu/$s.sh" 2>&1 | tee "$OUT/$s.log"; then status[$s]=ok; else status[$s]=FAILED; fi
  seconds[$s]=$(( $(date +%s) - t ))
done
echo
echo "| section | result | seconds |"
echo "|---|---|---|"
for s in "${sections[@]}"; do echo "| $s | ${status[$s]} | ${seconds[$s]} |"; done
