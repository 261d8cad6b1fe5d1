#!/usr/bin/env bash
# Inter-node MORI-EP kernel types on the GPU machine (after the suite is built and installed).
#
#   bash tools/gpu/ep_internode.sh [stage ...]
#     probe     GDRCopy, UCX, NICs, topology, NVSHMEM transports; NCCL with two ranks on one GPU
#     bringup   NVSHMEM bring-up + put-with-signal self test at EP2, in each configuration below
#               until one passes: first forced onto a network transport (P2P off), last on its
#               default transports ("p2p"). Every configuration's result and last log lines are kept.
#     tests     tests/ep/test_gpu_internode.py (every type: bf16/fp8/fp32 rounds vs the reference,
#               graph replay for V1LL/AsyncLL, MORI_TEST_INTERNODE_ROUNDS back-to-back rounds) at the
#               configurations in INTERNODE_CONFIGS (default "4x1 4x2 8x1 8x4" = world x gpu_per_node),
#               in the mode the bring-up chose
#     timeout   the missing-peer timeout for every type at EP4 and EP8 in that mode
#     bench     python -m mori_core.bench ep for the inter-node types (EP2)
#   default: probe bringup tests timeout
#
# Ranks are placed by MORI_RANKS_PER_GPU (default auto): on one GPU all ranks share it, and
# gpu_per_node=1 makes each rank its own "node", so with P2P off every inter-node row goes through
# NVSHMEM's network transport. Logs go to $OUT; a summary table is printed last.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
STAGES=${*:-probe bringup tests timeout}
INTERNODE_CONFIGS=${INTERNODE_CONFIGS:-4x1 4x2 8x1 8x4}
SUMMARY="$OUT/internode_summary.txt"
: > "$SUMMARY"
PYTEST="$PY -m pytest -q -rs -p no:cacheprovider -o addopts= -s"
T=tests/ep/test_gpu_internode.py

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" >> "$OUT/$name.log"
  timeout --signal=INT --kill-after=10 "$limit" bash -c "$*" >> "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-22s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/$name.log" | tail -1)" | tee -a "$SUMMARY"
  return $rc
}

NVSH_LIB=$($PY -c "import importlib.util as u; print(list(u.find_spec('nvidia.nvshmem').submodule_search_locations)[0] + '/lib')" 2>/dev/null)
UCX_WHEEL_LIB=$($PY -c "import importlib.util as u, os; s = u.find_spec('libucx'); print(os.path.join(list(s.submodule_search_locations)[0], 'lib') if s else '')" 2>/dev/null)
# Network configurations, tried in this order (P2P off: every PE pair goes through the transport).
NET_UCX="NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx UCX_TLS=tcp,cuda_copy"
CONFIGS=("ucx-nogdr|$NET_UCX NVSHMEM_DISABLE_GDRCOPY=1"
         "ucx|$NET_UCX"
         "ucx-lo|$NET_UCX UCX_NET_DEVICES=lo NVSHMEM_DISABLE_GDRCOPY=1"
         "ucx-sm|NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx UCX_TLS=sm,self,cuda_copy,cuda_ipc NVSHMEM_DISABLE_GDRCOPY=1"
         "ibrc|NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ibrc"
         "libfabric|NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=libfabric NVSHMEM_DISABLE_GDRCOPY=1"
         "p2p|")
[ -n "$UCX_WHEEL_LIB" ] && CONFIGS=("${CONFIGS[@]:0:3}" "ucx-wheel|$NET_UCX NVSHMEM_DISABLE_GDRCOPY=1 LD_LIBRARY_PATH=$UCX_WHEEL_LIB:\${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$UCX_WHEEL_LIB/ucx" "${CONFIGS[@]:3}")
MODE=""; MODE_ENV=""

for s in $STAGES; do
  case $s in
    probe)
      { echo "nvshmem lib: $NVSH_LIB"; ls -l /dev/gdrdrv 2>&1; grep -i gdrdrv /proc/modules 2>&1; ldconfig -p | grep -i -E "gdrapi|libucp|libibverbs|libfabric";
        command -v ucx_info && ucx_info -v && ucx_info -d | grep -E "Memory domain|Transport|Device" | head -40;
        echo "libucx wheel lib: ${UCX_WHEEL_LIB:-none}"; ls "$NVSH_LIB"; ldd "$NVSH_LIB"/nvshmem_transport_ucx.so.*;
        command -v ibv_devices && ibv_devices; ip -brief addr; nvidia-smi topo -m; nvidia-smi -q | grep -i -E "compute mode|mps" ;
        $PY -c "import mori_core; print(mori_core.build_info())"; } > "$OUT/probe.log" 2>&1
      grep -E "internode|gdrdrv|No such|ucx_info|Transport: (tcp|cuda)|Compute Mode" "$OUT/probe.log" | head -12 >> "$SUMMARY"
      # NCCL's device API would need an NCCL communicator across the ranks sharing the GPU.
      stage nccl_two_ranks_one_gpu 90 "NCCL_DEBUG=WARN $PY tools/gpu/nccl_shared_gpu_probe.py"
      grep -E "NCCL-PROBE" "$OUT/nccl_two_ranks_one_gpu.log" | head -4 | cut -c1-300 >> "$SUMMARY" ;;
    bringup)
      for c in "${CONFIGS[@]}"; do
        name=${c%%|*}; envs=${c#*|}
        t0=$SECONDS
        echo "=== bringup_$name: $envs" > "$OUT/bringup_$name.log"
        timeout --signal=INT --kill-after=5 ${BRINGUP_TIMEOUT:-35} bash -c "env $envs NVSHMEM_DEBUG=WARN MORI_TEST_NET_MODE='$name' MORI_BOOTSTRAP_TIMEOUT=30 $PYTEST '$T::test_nvshmem_bringup[2]'" >> "$OUT/bringup_$name.log" 2>&1
        rc=$?
        printf '%-22s rc=%-3s %4ss\n' "bringup_$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
        if [ $rc = 0 ]; then MODE=$name; MODE_ENV=$envs; break; fi
        echo "  last lines of bringup_$name.log:" >> "$SUMMARY"
        grep -v "^\s*$" "$OUT/bringup_$name.log" | grep -v "^=== " | grep -E -i "error|warn|fail|abort|timed out|refus|not |unable|cannot|assert" | tail -6 | cut -c1-240 | sed 's/^/    /' >> "$SUMMARY"
      done
      echo "mode: ${MODE:-none passed} ${MODE_ENV}" | tee -a "$SUMMARY"
      if [ -n "$MODE" ]; then
        stage "bringup_${MODE}_ep4_ep8" 120 "env $MODE_ENV MORI_TEST_NET_MODE=$MODE $PYTEST '$T::test_nvshmem_bringup[4]' '$T::test_nvshmem_bringup[8]'"
      fi ;;
    tests)
      if [ -z "$MODE" ] && [[ " $STAGES " != *" bringup "* ]]; then MODE=p2p; fi
      [ -z "$MODE" ] && { echo "tests: skipped (no NVSHMEM configuration came up)" | tee -a "$SUMMARY"; continue; }
      for c in $INTERNODE_CONFIGS; do
        stage "tests_${MODE}_$c" 400 "env $MODE_ENV MORI_TEST_NET_MODE=$MODE MORI_TEST_INTERNODE_CONFIGS=$c $PYTEST '$T::test_internode_kernel_types[$c]'"
        grep -h "INTERNODE rank=0" "$OUT/tests_${MODE}_$c.log" | cut -c1-240 >> "$SUMMARY"
      done ;;
    timeout)
      [ -z "$MODE" ] && { echo "timeout: skipped (no NVSHMEM configuration came up)" | tee -a "$SUMMARY"; continue; }
      stage "timeout_$MODE" 300 "env $MODE_ENV MORI_TEST_NET_MODE=$MODE $PYTEST '$T::test_timeout_names_the_missing_peer[4]' '$T::test_timeout_names_the_missing_peer[8]'"
      grep -h "TIMEOUT" "$OUT/timeout_$MODE.log" | cut -c1-240 | head -8 >> "$SUMMARY" ;;
    bench)
      stage bench 200 "env $MODE_ENV $PY -m mori_core.bench ep --world-size 2 --kernel-type InterNodeV1,InterNodeV1LL,AsyncLL,InterNode --gpu-per-node 1 --tokens 128,1024 --dtypes bf16 --iters 5 --json $OUT/bench_internode.json" ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done

echo; echo "===== inter-node summary (mode: ${MODE:-none})"; cat "$SUMMARY"
[ -f "$OUT/bench.log" ] && { echo "----- bench"; grep -E "^\||^###|Error" "$OUT/bench.log" | head -40; }
! grep -qE "^(tests|timeout)_.*rc=[1-9]" "$SUMMARY"
