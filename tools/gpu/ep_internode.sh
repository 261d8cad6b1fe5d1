#!/usr/bin/env bash
# Inter-node MORI-EP kernel types on the GPU machine (after the suite is built and installed).
#
#   bash tools/gpu_check.sh ep_internode                         (stages: $EP_INTERNODE_STAGES, default p2p)
#   EP_INTERNODE_STAGES="pair quad oct bench4" bash tools/gpu_check.sh ep_internode
#   bash tools/gpu/ep_internode.sh [stage ...]                   (arguments override the variable)
#
# "p2p" (the default) = "pair quad oct bench4": the final run of issue #30. NVSHMEM on its default
# transport (P2P over NVLink: no NIC, no GDRCopy here), within EP_INTERNODE_BUDGET seconds (default
# 150) on 4 GPUs. Every inter-node test runs both network paths: auto (every peer node
# load/store-reachable, written directly; asserted) and put (MORI_EP_INTERNODE_PATH=put: staged
# NVSHMEM puts over P2P), EP_INTERNODE_ROUNDS back-to-back rounds (default 200) after the
# reference-checked rounds, graph replay for V1LL/AsyncLL.
#   pair    in parallel: GPUs 0,1: tests 2x1 (every type on both paths), then the missing-peer timeout
#           at EP4 (2 ranks/GPU; every type on both paths); GPUs 2,3: EP2 benchmark (V1LL, AsyncLL on
#           both paths, IntraNode, NCCL, DeepEP LL; 128/512 tokens, fp8/bf16 dispatch, bf16 combine)
#   quad    tests 4x1 (one rank per GPU: every type on both paths) and 4x2 (every type once, both paths
#           over the types: MORI_TEST_INTERNODE_PATH_SPLIT), 2 reference rounds per dtype case
#   oct     tests 8x1 and 8x4 (two ranks per GPU): every type once per configuration, alternating paths,
#           so the two configurations run every (type, path); 1 reference round per dtype case, no graph
#           replay (it runs at 2x1, 4x1 and 4x2): with ranks sharing a GPU the reference op exchanges
#           rows over gloo, through the host (the likely bulk of EP8's time). Capped so that bench4
#           keeps 43 s
#   bench4  EP4 benchmark, one invocation: V1LL and AsyncLL at 128/512 (sized for 512, as DeepEP LL),
#           InterNode and InterNodeV1 at 128/512/4096, IntraNode, NCCL, DeepEP LL (128/512), both paths,
#           the kernel phase table, a small launch sweep of InterNodeV1 at 4096; the side-by-side tables
# Round 1 ran quad and oct at the same time (12 processes on 4 GPUs): both were still passing,
# slowly, when their 70 s caps hit (spin-waiting kernels of processes sharing a GPU only run
# when the GPU switches context). Here every stage has the GPUs to itself.
# Older stages (slow; they try NVSHMEM network transports): probe bringup tests timeout bench.
#
# Logs go to $OUT; a summary is printed last; exit status non-zero when a test failed.
# shellcheck source=tools/gpu/lib/budget_steps.sh
source "$(dirname "$0")/lib/budget_steps.sh"  # section_start, left (this section's steps are `stage`)
section_start internode "${EP_INTERNODE_BUDGET:-150}"
STAGES=${*:-${EP_INTERNODE_STAGES:-p2p}}
STAGES=${STAGES//p2p/pair quad oct bench4}
ROUNDS=${EP_INTERNODE_ROUNDS:-200}
DEEPEP=${DEEPEP_DIR:-/tmp/deepep}
INTERNODE_CONFIGS=${INTERNODE_CONFIGS:-4x1 4x2 8x1 8x4}
PYTEST="$PY -m pytest -q -rs -p no:cacheprovider -o addopts= -s"
T=tests/ep/test_gpu_internode.py
TEST_ENV="MORI_TEST_NET_MODE=p2p MORI_TEST_INTERNODE_PATHS=auto,put MORI_TEST_INTERNODE_EXPECT_DIRECT=1"

stage() {  # stage NAME CAP CMD...: runs CMD with timeout min(CAP, budget left - 3 s); skipped under 10 s
  local name=$1 cap=$2; shift 2
  local limit t0=$SECONDS
  limit=$(( $(left) - 3 )); [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt 10 ]; then
    printf '%-24s SKIPPED (budget: %ss left)\n' "$name" "$(left)" | tee -a "$SUMMARY"; return 0
  fi
  echo "=== $name (limit ${limit}s): $*" >> "$OUT/$name.log"
  timeout --signal=INT --kill-after=5 "$limit" bash -c "$*" >> "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-24s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/$name.log" | tail -1)" | tee -a "$SUMMARY"
  return $rc
}

wait_deepep() {  # bounded wait for tools/gpu/deepep_build.sh (started by the lead) to finish
  local limit=$1 t0=$SECONDS
  while [ ! -f "$DEEPEP/ok" ] && [ ! -f "$DEEPEP/failed" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 1; done
  if [ -f "$DEEPEP/ok" ]; then echo "deepep: ready after waiting $((SECONDS - t0)) s"
  else echo "deepep: not available ($( [ -f "$DEEPEP/failed" ] && echo build failed || echo "not ready after ${limit} s")); benchmarks run without it"; fi
}

BENCH="$PY -m mori_core.bench ep --gpu-per-node 1 --dtypes fp8,bf16 --net-paths auto,put --deepep-ll --no-graph"
LL_KINDS=InterNodeV1LL,AsyncLL,InterNode,InterNodeV1,IntraNode
NVSH_LIB=$($PY -c "import importlib.util as u; print(list(u.find_spec('nvidia.nvshmem').submodule_search_locations)[0] + '/lib')" 2>/dev/null)
UCX_WHEEL_LIB=$($PY -c "import importlib.util as u, os; s = u.find_spec('libucx'); print(os.path.join(list(s.submodule_search_locations)[0], 'lib') if s else '')" 2>/dev/null)
# Network configurations of the old bring-up stage, tried in this order (P2P off: every PE pair goes through the transport).
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

echo "stages: $STAGES (budget ${BUDGET}s)" | tee -a "$SUMMARY"
for s in $STAGES; do
  case $s in
    pair)
      { stage tests_2x1 30 "CUDA_VISIBLE_DEVICES=0,1 $TEST_ENV MORI_TEST_INTERNODE_ROUNDS=$ROUNDS $PYTEST '$T::test_internode_kernel_types[2]'"
        stage timeout_ep4 25 "CUDA_VISIBLE_DEVICES=0,1 $TEST_ENV $PYTEST '$T::test_timeout_names_the_missing_peer[4]'"; } &
      { wait_deepep 30 > "$OUT/deepep_wait.log"
        stage bench_ep2 45 "CUDA_VISIBLE_DEVICES=2,3 PYTHONPATH=$DEEPEP/DeepEP-1.2.1:\${PYTHONPATH:-} $BENCH --world-size 2 --kernel-type InterNodeV1LL,AsyncLL,IntraNode --tokens 128,512 --json $OUT/bench_ep2.json"; } &
      wait
      cat "$OUT/deepep_wait.log" | tee -a "$SUMMARY" ;;
    quad)
      stage tests_4x 38 "$TEST_ENV MORI_TEST_INTERNODE_ROUNDS=$ROUNDS MORI_TEST_INTERNODE_CASE_ROUNDS=2 MORI_TEST_INTERNODE_CONFIGS=4x1,4x2 MORI_TEST_INTERNODE_PATH_SPLIT=4x2 $PYTEST '$T::test_internode_kernel_types[4]'" ;;
    oct)  # capped so that bench4 (next) keeps 43 s of the budget: it prints the final tables
      # EP_INTERNODE_OCT_CONFIGS / EP_INTERNODE_OCT_CAP: which of 8x1,8x4 and how long (default both, 45 s).
      # The path alternation starts at the first configuration named: 8x4 alone gets 8x1's (type, path)
      # pairs, not the other half (round 3 ran it so: InterNode/V1LL direct, V1/AsyncLL put at EP8).
      cap=$(( $(left) - 43 )); [ "$cap" -gt "${EP_INTERNODE_OCT_CAP:-45}" ] && cap=${EP_INTERNODE_OCT_CAP:-45}
      oct=${EP_INTERNODE_OCT_CONFIGS:-8x1,8x4}
      stage tests_8x "$cap" "$TEST_ENV MORI_TEST_INTERNODE_ROUNDS=$ROUNDS MORI_TEST_INTERNODE_CASE_ROUNDS=1 MORI_TEST_INTERNODE_GRAPH=0 MORI_TEST_INTERNODE_CONFIGS=$oct MORI_TEST_INTERNODE_PATH_SPLIT=$oct $PYTEST '$T::test_internode_kernel_types[8]'" ;;
    bench4)
      wait_deepep 10 | tee -a "$SUMMARY"
      # EP_INTERNODE_BENCH4_CAP (default 48 s); EP_INTERNODE_SWEEP=0 drops the InterNodeV1 knob sweep
      sweep="--sweep --sweep-types InterNodeV1"; [ "${EP_INTERNODE_SWEEP:-1}" = 0 ] && sweep=""
      stage bench_ep4 "${EP_INTERNODE_BENCH4_CAP:-48}" "PYTHONPATH=$DEEPEP/DeepEP-1.2.1:\${PYTHONPATH:-} $BENCH --world-size 4 --kernel-type $LL_KINDS --tokens 128,512,4096 --ll-tokens 128,512 $sweep --json $OUT/bench_ep4.json" ;;
    probe)
      { echo "nvshmem lib: $NVSH_LIB"; ls -l /dev/gdrdrv 2>&1; grep -i gdrdrv /proc/modules 2>&1; ldconfig -p | grep -i -E "gdrapi|libucp|libibverbs|libfabric";
        command -v ucx_info && ucx_info -v && ucx_info -d | grep -E "Memory domain|Transport|Device" | head -40;
        echo "libucx wheel lib: ${UCX_WHEEL_LIB:-none}"; ls "$NVSH_LIB"; ldd "$NVSH_LIB"/nvshmem_transport_ucx.so.*;
        command -v ibv_devices && ibv_devices; ip -brief addr; nvidia-smi topo -m; nvidia-smi -q | grep -i -E "compute mode|mps" ;
        $PY -c "import mori_core; print(mori_core.build_info())"; } > "$OUT/probe.log" 2>&1
      grep -E "internode|gdrdrv|No such|ucx_info|Transport: (tcp|cuda)|Compute Mode" "$OUT/probe.log" | head -12 >> "$SUMMARY"
      # NCCL's device API would need an NCCL communicator across the ranks sharing the GPU.
      BUDGET=100000 stage nccl_two_ranks_one_gpu 90 "NCCL_DEBUG=WARN $PY tools/gpu/nccl_shared_gpu_probe.py"
      grep -E "NCCL-PROBE" "$OUT/nccl_two_ranks_one_gpu.log" | head -4 | cut -c1-300 >> "$SUMMARY" ;;
    bringup)
      for c in "${CONFIGS[@]}"; do
        name=${c%%|*}; envs=${c#*|}
        t0=$SECONDS
        echo "=== bringup_$name: $envs" > "$OUT/bringup_$name.log"
        timeout --signal=INT --kill-after=5 ${BRINGUP_TIMEOUT:-35} bash -c "env $envs NVSHMEM_DEBUG=WARN MORI_TEST_NET_MODE='$name' MORI_BOOTSTRAP_TIMEOUT=30 $PYTEST '$T::test_nvshmem_bringup[2]'" >> "$OUT/bringup_$name.log" 2>&1
        rc=$?
        printf '%-24s rc=%-3s %4ss\n' "bringup_$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
        if [ $rc = 0 ]; then MODE=$name; MODE_ENV=$envs; break; fi
        echo "  last lines of bringup_$name.log:" >> "$SUMMARY"
        grep -v "^\s*$" "$OUT/bringup_$name.log" | grep -v "^=== " | grep -E -i "error|warn|fail|abort|timed out|refus|not |unable|cannot|assert" | tail -6 | cut -c1-240 | sed 's/^/    /' >> "$SUMMARY"
      done
      echo "mode: ${MODE:-none passed} ${MODE_ENV}" | tee -a "$SUMMARY" ;;
    tests)
      if [ -z "$MODE" ] && [[ " $STAGES " != *" bringup "* ]]; then MODE=p2p; fi
      [ -z "$MODE" ] && { echo "tests: skipped (no NVSHMEM configuration came up)" | tee -a "$SUMMARY"; continue; }
      for w in 2 4 8; do
        BUDGET=100000 stage "tests_${MODE}_ep$w" 400 "env $MODE_ENV MORI_TEST_NET_MODE=$MODE MORI_TEST_INTERNODE_CONFIGS=${INTERNODE_CONFIGS// /,},2x1 $PYTEST '$T::test_internode_kernel_types[$w]'"
      done ;;
    timeout)
      [ -z "$MODE" ] && { echo "timeout: skipped (no NVSHMEM configuration came up)" | tee -a "$SUMMARY"; continue; }
      BUDGET=100000 stage "timeout_$MODE" 300 "env $MODE_ENV MORI_TEST_NET_MODE=$MODE $PYTEST '$T::test_timeout_names_the_missing_peer[4]' '$T::test_timeout_names_the_missing_peer[8]'" ;;
    bench)
      BUDGET=100000 stage bench 200 "env $MODE_ENV $BENCH --world-size 2 --kernel-type InterNodeV1,InterNodeV1LL,AsyncLL,InterNode --tokens 128,1024 --json $OUT/bench_internode.json" ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done

# One table of a bench log: its "### TITLE" line, then its rows up to the blank line after them.
table() { awk -v t="### $2" 'index($0, t) == 1 {on = 1; print; next} on && /^\|/ {rows = 1; print; next} on && rows {exit}' "$OUT/$1.log" | grep -v "^|---" | cut -c1-200; }

echo; echo "===== inter-node summary ($((SECONDS - T0)) s of ${BUDGET}s)"; cat "$SUMMARY"
echo "----- per type, config and path (rank 0)"
cat "$OUT"/tests_*.log 2>/dev/null | grep -h -o "INTERNODE rank=0 type=[^:]*: \(PASS\|FAIL\)[^I]*" | cut -c1-200
cat "$OUT"/timeout_*.log 2>/dev/null | grep -h "^TIMEOUT" | cut -c1-160 | head -8
for f in bench_ep2 bench_ep4; do
  [ -f "$OUT/$f.log" ] && grep -E "skipped|failed|Error|error" "$OUT/$f.log" | grep -v IBGDA | head -4
done
echo "----- bench_ep4: where the device time goes at 4096 tokens (full tables in bench_ep4.log)"
table bench_ep4 "Where the device time goes" | grep -E "^### |^\| kernel| 4096 "
echo "===== final tables (eager us: median over back-to-back calls, a CUDA event pair around each; host us: host time per call)"
for f in bench_ep2 bench_ep4; do
  [ -f "$OUT/$f.log" ] || continue
  echo "----- $f"; table $f "Side by side"
done
echo "----- bench_ep4, 4096 tokens"; table bench_ep4 "Ours inter-node vs our IntraNode" | grep -E "^### |^\| inter-node| 4096 "
! grep -qE "^(tests|timeout)_.*rc=[1-9]" "$SUMMARY"
