#!/usr/bin/env bash
# GPU section of MORI-CCL, round 2 (the final run of issue #28; hard budget 140 s on 4 GPUs; the
# suite is built and installed by tools/gpu_check.sh):
#   test2   tests/ccl/test_gpu_ccl.py on GPUs 0,1: every collective x dtype x engine (auto, ce, sm)
#           x size (1 element .. 256 MiB per rank) against NCCL and the rank-order sum, unaligned,
#           in place, graph capture + replay, start_async/wait_async on two streams, 40
#           back-to-back calls across paths, bad input, AllGatherIntoTensor, the copy engines'
#           modes (copy signals, unbatched, split 1 and 3), a missing peer (~15 s; round 1 was
#           killed at 42 s by a CPU-side comparison of 256 MiB tensors, now on the GPU)
#   test4   the same suite on 4 GPUs, without the missing-peer part (~18 s)
#   bench   python -m mori_core.bench ccl at 4 GPUs, 8 KiB .. 256 MiB per rank: ours per engine
#           (auto, ce, sm) next to NCCL and torch symmetric memory (one-/two-shot) in the same run:
#           eager latency (slowest rank, median, event pair per call), host time per call, bus
#           bandwidth, CUDA-graph time for all-reduces <= 1 MiB; the GEMM overlap row (64 MiB
#           all-gather on copy engines split 2 / split 1, SMs, NCCL); copy-engine ceilings with
#           1/2/4 copies in flight per peer; a small sweep of what is still open (ce_split,
#           one- vs two-shot inside graphs, SM grids) (~30 s)
# Logs and the bench JSON go to $OUT; the tables and a summary are printed last; exit 1 when a
# stage fails.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
SUMMARY="$OUT/ccl_summary.txt"
: > "$SUMMARY"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
$PY -c "import mori_core; from mori_core import _C; print('ccl build:', mori_core.build_info().get('ccl'), '| copy engines:', _C.ccl_copy_engine_unavailable() or 'available')" 2>&1 | tee "$OUT/ccl_setup.txt"
PYTEST="$PY -m pytest -q -rfs -s -p no:cacheprovider -o addopts= tests/ccl/test_gpu_ccl.py"

stage() {  # stage NAME TIMEOUT CMD...: output to $OUT/ccl_NAME.log; never hangs the section
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== ccl $name ($(date +%T)): $*"
  timeout --signal=KILL "$limit" bash -c "$*" > "$OUT/ccl_$name.log" 2>&1
  local rc=$?
  printf '%-6s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E '[0-9]+ (passed|failed|skipped)|ccl benchmark:' "$OUT/ccl_$name.log" | tail -1)" | tee -a "$SUMMARY"
  [ $rc = 0 ] || { grep -E "failure|differs|Error|error|rank [0-9]+ parts" "$OUT/ccl_$name.log" | head -40; }
}

# Limits: 35 + 40 + 58 s at most, inside the 140 s budget with the setup line.
# CCL_STAGES picks stages (default "test2 test4 bench"); CCL_BENCH_S overrides the bench's limit.
STAGES=" ${CCL_STAGES:-test2 test4 bench} "
W=$(( ngpu >= 4 ? 4 : ngpu ))
if [[ $STAGES == *" test2 "* ]]; then
stage test2 35 "CUDA_VISIBLE_DEVICES=0,1 CCL_TEST_TIMEOUT=32 MORI_TEST_STACKS_AFTER_S=28 $PYTEST -k 'suite and 2'"
grep -h "parts:" "$OUT/ccl_test2.log" | head -2
fi
if [[ $STAGES != *" test4 "* ]]; then
  :
elif [ "$ngpu" -ge 4 ]; then
  stage test4 40 "CUDA_VISIBLE_DEVICES=0,1,2,3 CCL_TEST_TIMEOUT=37 MORI_TEST_STACKS_AFTER_S=33 $PYTEST -k 'suite and 4'"
  grep -h "parts:" "$OUT/ccl_test4.log" | head -4
else
  echo "test4 skipped: $ngpu GPU(s)" | tee -a "$SUMMARY"
fi
BENCH_S=${CCL_BENCH_S:-58}
[[ $STAGES == *" bench "* ]] && stage bench "$BENCH_S" "MORI_BENCH_STACKS_AFTER_S=$((BENCH_S - 6)) $PY -m mori_core.bench ccl --world-size $W --ceilings --sweep --json $OUT/ccl_bench.json"

echo
echo "===== ccl results"
awk '/^### /{p = ($0 ~ /best of ours|inside CUDA graphs|overlap|ceilings|sweep/)} p' "$OUT/ccl_bench.log" | grep -E "^###|^\|" | grep -v "^|--"
echo
echo "===== ccl summary ($ngpu GPU(s))"
cat "$SUMMARY"
! grep -qE "rc=[1-9]" "$SUMMARY"
