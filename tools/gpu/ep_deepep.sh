#!/usr/bin/env bash
# Issue #31 on the 4-GPU machine: IntraNode correctness at EP2 and EP4, then `bench ep` against
# DeepEP v1.2.1 (intranode) in the same processes, plus the launch-knob sweep for the table.
#
#   bash tools/gpu_check.sh ep_deepep          (or: bash tools/gpu/ep_deepep.sh [stage ...])
#
# Stages (default: all, in this order; every step bounded, the whole section by EP_DEEPEP_BUDGET s):
#   ep2      concurrently: on GPUs 2,3 the IntraNode suite (tests/ep/test_gpu_ep.py, EP2: every dtype,
#            push / pull / staged push / copy-pull / push kernel for pull calls, graphs, back-to-back
#            rounds) then the FP8-combine and standard-MoE cases (tests/ep/test_gpu_ep_extensions.py,
#            EP2); on GPUs 0,1 `bench ep` at EP2 with DeepEP (after waiting for its build)
#   ep4      both suites at EP4 on all four GPUs (the two test processes share the GPUs)
#   bench4   `bench ep` at EP4 with DeepEP, FP8 combine, standard MoE, the launch sweep (--tune), plot
# MORI_TEST_ROUNDS (default 100 here) sets the back-to-back round counts of the tests.
# DeepEP: tools/gpu/deepep_build.sh, started in the background by the lead into /tmp/deepep; this
# script waits (bounded) for /tmp/deepep/ok or /tmp/deepep/failed and runs without it otherwise.
# Logs, JSON and the PNG plots go to $OUT; a summary is printed last; exit 1 when a test failed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MORI_TEST_ROUNDS=${MORI_TEST_ROUNDS:-100}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
BUDGET=${EP_DEEPEP_BUDGET:-195}
DEEPEP=${DEEPEP_DIR:-/tmp/deepep}
STAGES=${*:-ep2 ep4 bench4}
SUMMARY="$OUT/ep_deepep_summary.txt"
: > "$SUMMARY"
PYTEST="$PY -m pytest -q -rs -p no:cacheprovider -o addopts=''"
T0=$SECONDS

left() { echo $(( BUDGET - (SECONDS - T0) )); }

run() {  # run NAME LIMIT CMD...: bounded by LIMIT and by what is left of the budget
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS cap
  cap=$(left); [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -le 5 ]; then printf '%-10s skipped (budget spent)\n' "$name" | tee -a "$SUMMARY"; return 124; fi
  echo "=== $name (limit ${limit}s): $*" > "$OUT/$name.log"
  timeout --signal=KILL "$limit" bash -c "$*" >> "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)" >> "$SUMMARY"
  return $rc
}

wait_deepep() {  # bounded wait for the lead's background build; sets DEEPEP_PATH when it is usable
  local limit=$1 t=0
  while [ ! -f "$DEEPEP/ok" ] && [ ! -f "$DEEPEP/failed" ] && [ "$t" -lt "$limit" ]; do sleep 2; t=$((t + 2)); done
  if [ -f "$DEEPEP/ok" ]; then
    DEEPEP_PATH="$DEEPEP/DeepEP-1.2.1"; echo "deepep: ready (waited ${t}s)" >> "$SUMMARY"
  else
    DEEPEP_PATH=""; echo "deepep: NOT available after ${t}s ($( [ -f "$DEEPEP/failed" ] && echo build failed || echo no ok file)); benches run without it" >> "$SUMMARY"
  fi
}

BENCH="$PY -m mori_core.bench ep --tokens 128,512,4096 --dtypes bf16,fp8 --auto --iters 10 --eager-calls 30 --fp8-combine --std-moe --deepep"
bench_cmd() {  # bench_cmd WORLD NAME EXTRA...
  local world=$1 name=$2; shift 2
  echo "MORI_SHMEM_HEAP_SIZE=8G PYTHONPATH=${DEEPEP_PATH:+$DEEPEP_PATH:}\${PYTHONPATH:-} $BENCH --world-size $world --json $OUT/$name.json --plot $OUT/$name.png $*"
}

for s in $STAGES; do
  case $s in
    ep2)
      ( run ep2_suite 60 "CUDA_VISIBLE_DEVICES=2,3 $PYTEST 'tests/ep/test_gpu_ep.py::test_ep_suite[2]'"
        run ep2_ext 60 "CUDA_VISIBLE_DEVICES=2,3 $PYTEST -s 'tests/ep/test_gpu_ep_extensions.py::test_standard_moe_and_fp8_combine[2]'" ) &
      TESTS_PID=$!
      wait_deepep 60
      run bench2 80 "CUDA_VISIBLE_DEVICES=0,1 $(bench_cmd 2 bench2)"
      wait "$TESTS_PID" ;;
    ep4)
      run ep4_suite 75 "$PYTEST 'tests/ep/test_gpu_ep.py::test_ep_suite[4]'" &
      SUITE_PID=$!
      run ep4_ext 75 "$PYTEST -s 'tests/ep/test_gpu_ep_extensions.py::test_standard_moe_and_fp8_combine[4]'"
      wait "$SUITE_PID" ;;
    bench4)
      [ -z "${DEEPEP_PATH+x}" ] && wait_deepep 30
      run bench4 90 "$(bench_cmd 4 bench4 --tune --tune-tokens 512,4096)" ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done

echo; echo "===== ep_deepep summary ($(nvidia-smi -L 2>/dev/null | wc -l) GPU(s), $((SECONDS - T0)) s of ${BUDGET} s)"
cat "$SUMMARY"
for f in ep2_ext ep4_ext; do
  [ -f "$OUT/$f.log" ] && { echo "----- $f"; grep -E "^\[rank 0\] (PASS|FAIL)|^  " "$OUT/$f.log" | head -40; }
done
for f in ep2_suite ep4_suite; do  # a failed suite: its first errors
  grep -qE "^$f +rc=0 " "$SUMMARY" || { [ -f "$OUT/$f.log" ] && { echo "----- $f (failed)";
    grep -E "Error|error|assert|differ|timed out|Traceback" "$OUT/$f.log" | head -25; }; }
done
tables() {  # tables FILE PATTERN...: the Markdown tables whose titles match
  local f=$1; shift
  for pat in "$@"; do
    awk -v pat="$pat" 'index($0, pat) && /^###/ {on=1; rows=0} on && /^\|/ {rows++; print; next}
                       on && /^###/ {print; next} on && rows && !/^\|/ {on=0}' "$f"
  done
}
for f in bench2 bench4; do
  [ -f "$OUT/$f.log" ] || continue
  echo "----- $f (targets, DeepEP comparison, checks, FP8 combine, standard MoE, launch sweep best)"
  tables "$OUT/$f.log" "issue #31 targets" "ours vs DeepEP at its best" "same data, both libraries" "FP8 combine vs BF16" \
    "standard-MoE layout" "best per kernel)" | head -150
  grep -E "^wrote |--deepep: skipped|Traceback|Error" "$OUT/$f.log" | head -5
done
ls "$OUT"/*.png 2>/dev/null
! grep -E "^(ep2_suite|ep2_ext|ep4_suite|ep4_ext) " "$SUMMARY" | grep -qvE "rc=0 "
