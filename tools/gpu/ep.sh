#!/usr/bin/env bash
# MORI-EP on the GPU machine: build, GPU tests on 2 and 4 GPUs, benchmarks.
#
#   bash tools/gpu/ep.sh [stage ...]     stages: build test1 test2 test4 bench1 bench2 bench4 sms2 sms4 sweep4 sweep2
#                                        (default: build test2 test4 bench4 bench2 sms2, or test1 bench1 on a
#                                        one-GPU machine; stages needing more GPUs than are visible are skipped)
#   bench*: eager per-call latency, host time per call and graph replay per kernel (AUTO table);
#   sms*:   the same with every kernel at 24 blocks (DeepEP's 24-SM setting).
#   BENCH_ARGS overrides the bench options (default: --auto --iters 20, the tuned launch table).
#
# Logs and JSON go to $OUT (or ./out); a short summary is printed last.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# Under tools/gpu_check.sh the suite is already built and installed.
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
DEFAULT="test2 test4 bench4 bench2 sms2"
[ "$NGPU" -lt 2 ] && DEFAULT="test1 bench1"   # one-GPU machines: EP1 (every token local)
if [ "${MORI_GPU_CHECK_BUILT:-0}" = 1 ]; then STAGES=${*:-$DEFAULT}; else STAGES=${*:-build $DEFAULT}; fi
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
cd "$(dirname "$0")/../.."

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$OUT/$name.log"
  timeout --signal=KILL "$limit" bash -c "$*" >> "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-8s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
  return $rc
}

for s in $STAGES; do
  case $s in
    *2) if [ "$NGPU" -lt 2 ]; then echo "$s: skipped ($NGPU GPU visible)" | tee -a "$SUMMARY"; continue; fi ;;
    *4) if [ "$NGPU" -lt 4 ]; then echo "$s: skipped ($NGPU GPUs visible)" | tee -a "$SUMMARY"; continue; fi ;;
  esac
  case $s in
    build)
      nvidia-smi -L >> "$OUT/build.log" 2>&1; nvidia-smi topo -m >> "$OUT/build.log" 2>&1
      stage build 240 "CMAKE_BUILD_PARALLEL_LEVEL=\$(nproc) MORI_CUDA_ARCH=90 $PY -m pip install -v --no-build-isolation --no-deps . && $PY -c 'import mori_core; print(mori_core.build_info())'"
      grep -E " [1-9][0-9]* bytes spill stores| error" "$OUT/build.log" | head -20 >> "$SUMMARY" ;;
    test2)
      stage test2 150 "CUDA_VISIBLE_DEVICES=0,1 $PY -m pytest -q -x -p no:cacheprovider -o addopts='' 'tests/ep/test_gpu_ep.py::test_shmem_unique_id_without_torch_distributed' 'tests/ep/test_gpu_ep.py::test_ep_suite[2]' 'tests/ep/test_gpu_ep.py::test_timeout_names_the_missing_peer'"
      tail -3 "$OUT/test2.log" >> "$SUMMARY" ;;
    test1)
      stage test1 150 "CUDA_VISIBLE_DEVICES=0 $PY -m pytest -q -x -p no:cacheprovider -o addopts='' 'tests/ep/test_gpu_ep.py::test_ep_suite_single_gpu'"
      tail -3 "$OUT/test1.log" >> "$SUMMARY" ;;
    bench1)
      stage bench1 90 "CUDA_VISIBLE_DEVICES=0 $PY -m mori_core.bench ep --world-size 1 --tokens 128,512,4096 --dtypes bf16,fp8 --json $OUT/bench_ep1.json ${BENCH_ARGS:---auto --iters 20}" ;;
    test4)
      stage test4 130 "$PY -m pytest -q -x -p no:cacheprovider -o addopts='' 'tests/ep/test_gpu_ep.py::test_ep_suite[4]'"
      tail -3 "$OUT/test4.log" >> "$SUMMARY" ;;
    bench4)
      stage bench4 120 "$PY -m mori_core.bench ep --world-size 4 --tokens 128,512,4096 --dtypes bf16,fp8 --json $OUT/bench_ep4.json ${BENCH_ARGS:---auto --iters 20}" ;;
    bench2)
      stage bench2 90 "CUDA_VISIBLE_DEVICES=0,1 $PY -m mori_core.bench ep --world-size 2 --tokens 128,512,4096 --dtypes bf16,fp8 --json $OUT/bench_ep2.json ${BENCH_ARGS:---auto --iters 20}" ;;
    sms2)
      stage sms2 90 "CUDA_VISIBLE_DEVICES=0,1 $PY -m mori_core.bench ep --world-size 2 --tokens 128,512,4096 --dtypes bf16,fp8 --sms 24 --json $OUT/bench_ep2_sms24.json" ;;
    sms4)
      stage sms4 120 "$PY -m mori_core.bench ep --world-size 4 --tokens 128,512,4096 --dtypes bf16,fp8 --sms 24 --json $OUT/bench_ep4_sms24.json" ;;
    sweep4)
      stage sweep4 240 "$PY -m mori_core.bench ep --world-size 4 --tokens 128,512,4096 --dtypes bf16,fp8 --sweep --iters 10 --json $OUT/sweep_ep4.json" ;;
    sweep2)
      stage sweep2 180 "CUDA_VISIBLE_DEVICES=0,1 $PY -m mori_core.bench ep --world-size 2 --tokens 128,512,4096 --dtypes bf16,fp8 --sweep --iters 10" ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done

echo; echo "===== summary"; cat "$SUMMARY"
for f in bench4 bench2 bench1 sms2 sms4 sweep4 sweep2; do
  [ -f "$OUT/$f.log" ] && { echo "----- $f"; sed -n '/best per kernel/,$p' "$OUT/$f.log" | grep -E "^\||^###" | head -40; grep -q "best per kernel" "$OUT/$f.log" || grep -E "^\||^###" "$OUT/$f.log" | tail -40; }
done
exit 0
