#!/usr/bin/env bash
# Issue #15 on the GPU machine: standard-MoE layout, FP8 combine, kernel profiler.
#
#   bash tools/gpu/ep15.sh [stage ...]    stages: tests regress prof bench vllm (default: all, in this order)
#
# Test stages run at every EP size in EP_WORLDS (default "1 2 4 8"). Ranks are placed by
# MORI_RANKS_PER_GPU (default auto): one per GPU where there are enough GPUs, otherwise several
# ranks share a GPU (python/mori_core/placement.py), so EP2/EP4/EP8 run on one GPU too.
#   tests    tests/ep/test_gpu_ep_extensions.py: 15 cases (standard MoE fused and converted vs the
#            reference, FP8 combine push/pull, CUDA graph, 100 rounds, stale layout) + no-profiler check
#   regress  the IntraNode GPU suite at EP1 (the EP2/4/8 runs are tools/gpu/ep.sh's)
#   bench    python -m mori_core.bench ep --fp8-combine --std-moe (FP8 vs BF16 combine, standard-MoE rows)
#            at EP $BENCH_WORLD (default: the GPU count; timings of shared GPUs are not meaningful)
#   vllm     tests/integrations/vllm/test_vllm_gpu_exchange.py (adapter exchange, flat + batched layouts)
#   prof     a second, profiler-enabled build (pip --target /tmp/prof_site, built in the background
#            while the other stages run) and the profiler test against it (Perfetto JSON from every rank)
# Logs go to $OUT (or ./out); a short summary is printed last.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
EP_WORLDS=${EP_WORLDS:-1 2 4 8}
BENCH_WORLD=${BENCH_WORLD:-$NGPU}
# pytest -k expression selecting the parametrised EP sizes: "[1] or [2] or ..."
KW=$(for w in $EP_WORLDS; do printf '%s' "$w] or "; done)
KW="(${KW% or })"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
# prof before bench: the background profiler build (CPU-heavy) must be finished before anything is timed.
STAGES=${*:-tests regress prof bench vllm}
SUMMARY="$OUT/ep15_summary.txt"
: > "$SUMMARY"
PROF_SITE=/tmp/prof_site
PYTEST="$PY -m pytest -q -rs -p no:cacheprovider -o addopts=''"

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$OUT/$name.log"
  timeout --signal=KILL "$limit" bash -c "$*" >> "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-8s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
  return $rc
}

PROF_PID=""
if [[ " $STAGES " == *" prof "* ]]; then
  # CPU-only work: overlaps the GPU stages. Separate build dir and install target (the normal
  # install stays untouched); MORI_ENABLE_PROFILER compiles the per-warp timestamps in.
  rm -rf "$PROF_SITE"
  ( t0=$SECONDS
    CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) > 4 ? $(nproc) - 2 : 2 )) MORI_CUDA_ARCH=90 \
      $PY -m pip install --no-build-isolation --no-deps --target "$PROF_SITE" -Cbuild-dir=/tmp/prof_build \
      -Ccmake.define.MORI_ENABLE_PROFILER=ON . > /tmp/ep15_profbuild.log 2>&1
    echo "profiler build rc=$? in $((SECONDS - t0)) s" >> /tmp/ep15_profbuild.log ) &
  PROF_PID=$!
fi

for s in $STAGES; do
  case $s in
    tests)
      stage tests 480 "$PYTEST -s tests/ep/test_gpu_ep_extensions.py -k 'not profiler_trace and ($KW or absent)'"
      grep -cE "^\[rank [0-9]+\] PASS" "$OUT/tests.log" | sed 's/^/  rank-case passes: /' >> "$SUMMARY"
      grep -E "^\[rank [0-9]+\] FAIL|passed|failed|skipped" "$OUT/tests.log" | tail -15 >> "$SUMMARY" ;;
    regress)
      stage regress 150 "$PYTEST 'tests/ep/test_gpu_ep.py::test_ep_suite_single_gpu'"
      tail -2 "$OUT/regress.log" >> "$SUMMARY" ;;
    bench)
      [ -n "$PROF_PID" ] && { echo "bench: waiting for the profiler build" | tee -a "$SUMMARY"; wait "$PROF_PID"; PROF_PID=""; }
      stage bench 150 "$PY -m mori_core.bench ep --world-size $BENCH_WORLD --tokens 128,4096 --dtypes bf16 --zero-copy both --auto --iters 20 --no-nccl --fp8-combine --std-moe" ;;
    vllm)
      stage vllm 420 "$PYTEST tests/integrations/vllm/test_vllm_gpu_exchange.py -k '$KW or reference'"
      tail -3 "$OUT/vllm.log" >> "$SUMMARY" ;;
    prof)
      [ -n "$PROF_PID" ] && wait "$PROF_PID"
      PROF_PID=""
      tail -25 /tmp/ep15_profbuild.log > "$OUT/prof.log"
      stage prof 150 "PYTHONPATH=$PROF_SITE:$PROF_SITE/mori_suite_alias\${PYTHONPATH:+:\$PYTHONPATH} $PY -c 'import mori_core; print(mori_core.__file__, mori_core.build_info())' && PYTHONPATH=$PROF_SITE:$PROF_SITE/mori_suite_alias\${PYTHONPATH:+:\$PYTHONPATH} $PYTEST tests/ep/test_gpu_ep_extensions.py -k 'profiler_trace and $KW'"
      grep -E "profiler phases|passed|failed|skipped|rc=" "$OUT/prof.log" | tail -6 >> "$SUMMARY" ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done

echo; echo "===== ep15 summary (EP sizes $EP_WORLDS, $NGPU GPU(s) visible, MORI_RANKS_PER_GPU=${MORI_RANKS_PER_GPU:-auto})"; cat "$SUMMARY"
[ -f "$OUT/bench.log" ] && { echo "----- bench (FP8 / standard-MoE tables)"; sed -n '/FP8 combine vs BF16/,$p' "$OUT/bench.log" | grep -E "^\||^###" | head -30; }
exit 0
