#!/usr/bin/env bash
# MORI-EP IntraNode on the GPU machine: the GPU suite at EP1/EP2/EP4/EP8, benchmarks.
#
#   bash tools/gpu/ep.sh [stage ...]
#     build                     pip install the suite (skipped under tools/gpu_check.sh, which builds)
#     test1 test2 test4 test8   tests/ep/test_gpu_ep.py at that EP size: BF16/FP32/FP8+scales, push,
#                               pull and zero-copy, graph capture + replay, 1000 back-to-back rounds,
#                               hot-path argument errors, capacity overflow, routing mismatch
#     misc                      the missing-peer timeout (EP2) and shmem over a unique id (EP2)
#     stress                    1000 back-to-back rounds at EP8, pull then push, random token counts
#                               (0 included), the dispatch outputs fed straight back into combine
#                               (the stress the small-batch synchronisation changes of #19 passed)
#     bench1 bench2 bench4 bench8  python -m mori_core.bench ep at that EP size (eager, host, graph)
#     sms2 sms4                 the same with every kernel at 24 blocks (DeepEP's 24-SM setting)
#     sweep2 sweep4             launch-grid sweep
#   default: test1 test2 test4 test8 misc stress bench1 bench2
#
# Ranks are placed by MORI_RANKS_PER_GPU (python/mori_core/placement.py; default auto): one
# rank per GPU where there are enough GPUs, otherwise several ranks share a GPU (separate
# processes, CUDA IPC to the same device, gloo instead of NCCL). Shared placements test
# correctness and host time; their kernel timings are not meaningful and the bench says so.
# BENCH_ARGS overrides the bench options (default: --auto --iters 20, the tuned launch table).
# Logs and JSON go to $OUT (or ./out); a short summary is printed last.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEFAULT="test1 test2 test4 test8 misc stress bench1 bench2"
if [ "${MORI_GPU_CHECK_BUILT:-0}" = 1 ]; then STAGES=${*:-$DEFAULT}; else STAGES=${*:-build $DEFAULT}; fi
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
cd "$(dirname "$0")/../.."
PYTEST="$PY -m pytest -q -rs -p no:cacheprovider -o addopts=''"
T=tests/ep/test_gpu_ep.py

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$OUT/$name.log"
  timeout --signal=KILL "$limit" bash -c "$*" >> "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-8s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/$name.log" | tail -1)" | tee -a "$SUMMARY"
  return $rc
}

bench() {  # bench NAME WORLD EXTRA...
  local name=$1 world=$2; shift 2
  stage "$name" 240 "$PY -m mori_core.bench ep --world-size $world --tokens 128,512,4096 --dtypes bf16,fp8 --json $OUT/$name.json $*"
}

for s in $STAGES; do
  case $s in
    build)
      nvidia-smi -L >> "$OUT/build.log" 2>&1
      stage build 300 "CMAKE_BUILD_PARALLEL_LEVEL=\$(nproc) MORI_CUDA_ARCH=90 $PY -m pip install -v --no-build-isolation --no-deps . && $PY -c 'import mori_core; print(mori_core.build_info())'"
      grep -E " [1-9][0-9]* bytes spill stores| error" "$OUT/build.log" | head -20 >> "$SUMMARY" ;;
    test1) stage test1 200 "$PYTEST '$T::test_ep_suite_single_gpu'" ;;
    test2|test4|test8) stage "$s" 420 "$PYTEST '$T::test_ep_suite[${s#test}]'" ;;
    misc) stage misc 200 "$PYTEST '$T::test_timeout_names_the_missing_peer' '$T::test_shmem_unique_id_without_torch_distributed'" ;;
    stress) stage stress 300 "$PYTEST '$T::test_back_to_back_rounds[8]'" ;;
    bench1|bench2|bench4|bench8) bench "$s" "${s#bench}" "${BENCH_ARGS:---auto --iters 20}" ;;
    sms2|sms4) bench "$s" "${s#sms}" --sms 24 ;;
    sweep2|sweep4) bench "$s" "${s#sweep}" --sweep --iters 10 ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done

echo; echo "===== ep summary ($(nvidia-smi -L 2>/dev/null | wc -l) GPU(s) visible, MORI_RANKS_PER_GPU=${MORI_RANKS_PER_GPU:-auto})"; cat "$SUMMARY"
for f in bench1 bench2 bench4 bench8 sms2 sms4 sweep2 sweep4; do
  [ -f "$OUT/$f.log" ] && { echo "----- $f"; sed -n '/best per kernel/,$p' "$OUT/$f.log" | grep -E "^\||^###" | head -40; grep -q "best per kernel" "$OUT/$f.log" || grep -E "^\||^###" "$OUT/$f.log" | tail -40; }
done
! grep -qE "rc=[1-9]" "$SUMMARY"
