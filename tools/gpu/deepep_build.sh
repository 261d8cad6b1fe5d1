#!/usr/bin/env bash
# Build DeepEP v1.2.1 (a same-run baseline only, never a dependency of mori-suite) on the GPU machine.
#
#   bash tools/gpu/deepep_build.sh [DEST]      (default DEST=/tmp/deepep)
#
# Takes .baselines/DeepEP-1.2.1.tar.gz (copy it there from ../shared/baselines and name
# .baselines in the device tool's `carry`). On success DEST/DeepEP-1.2.1 holds an importable
# deep_ep package: `export PYTHONPATH=DEST/DeepEP-1.2.1:$PYTHONPATH`. Writes DEST/ok or
# DEST/failed so a caller that started this in the background can wait for either.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-/tmp/deepep}
SRC=$PWD/.baselines/DeepEP-1.2.1.tar.gz
mkdir -p "$DEST"; rm -f "$DEST/ok" "$DEST/failed"
if [ ! -f "$SRC" ]; then echo "deepep_build: $SRC missing (carry .baselines)"; touch "$DEST/failed"; exit 1; fi
t0=$SECONDS
(
  set -e
  cd "$DEST" && tar xzf "$SRC" && cd DeepEP-1.2.1
  CU=$(dirname "$(dirname "$(which nvcc)")")
  # NVSHMEM's headers include <cuda/std/tuple> (CCCL) from .cpp files.
  export CPLUS_INCLUDE_PATH=$CU/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
  export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-40}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python3 setup.py build_ext --inplace && cp deep_ep_cpp*.so deep_ep/
) > "$DEST/build.log" 2>&1
rc=$?
if [ $rc = 0 ] && PYTHONPATH=$DEST/DeepEP-1.2.1 python3 -c "import deep_ep" >> "$DEST/build.log" 2>&1; then
  touch "$DEST/ok"; echo "deepep_build: ok in $((SECONDS - t0)) s ($DEST/DeepEP-1.2.1)"
else
  touch "$DEST/failed"; echo "deepep_build: FAILED in $((SECONDS - t0)) s"; tail -30 "$DEST/build.log"; exit 1
fi
