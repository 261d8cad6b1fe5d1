#!/usr/bin/env bash
# Issue #27: the IO engine's host cost per region pair and per segment, before and after, on one
# machine: this tree's engine (installed by tools/gpu_check.sh) against a reference engine built
# from IO_REF_DIR (default .ref_engine: `git archive <commit> | tar -x -C .ref_engine`, carried),
# the two interleaved on GPUs 0 -> 1.
#
#   bash tools/gpu_check.sh io_ab          (IO_AB_ROUNDS rounds of each, default 2)
#
# First the engine's GPU tests of this tree (IO batches, the XGMI matrix's other cases, the SGLang
# transfer on two GPUs) while the reference builds; then per round and engine: `bench io --pieces`
# (one session call of 8,192 x 32 KiB, one engine call over 64 region pairs, 64 x 8 KiB) and
# `bench vllm-pd --agents` (vLLM WRITE/READ and the SGLang chunk: 66 region pairs). Logs go to
# $OUT; the tables last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REF=${IO_REF_DIR:-.ref_engine}
ROUNDS=${IO_AB_ROUNDS:-2}
REFSITE=/tmp/mori_ref_site
rc=0

NEWSITE=/tmp/mori_new_site
[ -d "$REF" ] || { echo "io_ab: no reference tree at $REF"; exit 1; }
rm -rf "$REFSITE" "$NEWSITE"
# Both engines are also installed the same way (pip --target), so that the comparison holds the
# installation fixed: "new" is the suite tools/gpu_check.sh installed, "newt" this tree again.
(CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 )) MORI_CUDA_ARCH=${MORI_CUDA_ARCH:-90} timeout 240 \
   $PY -m pip install -q --no-build-isolation --no-deps --target "$REFSITE" "$REF" > "$OUT/io_ab_ref_build.log" 2>&1
 echo $? > "$OUT/io_ab_ref_build.rc") &
BUILD=$!
if [ "${IO_AB_TARGET_NEW:-1}" = 1 ]; then
  (CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 )) MORI_CUDA_ARCH=${MORI_CUDA_ARCH:-90} timeout 240 \
     $PY -m pip install -q --no-build-isolation --no-deps --target "$NEWSITE" . > "$OUT/io_ab_newt_build.log" 2>&1
   echo $? > "$OUT/io_ab_newt_build.rc") &
  BUILD2=$!
fi

PYTEST="$PY -m pytest -q --tb=short -rfs -p no:cacheprovider --timeout 45"
IO_XGMI="not 1gpu and not proxy and not tcp_backend"
t0=$SECONDS
if [ "${IO_AB_TESTS:-1}" = 1 ]; then
CUDA_VISIBLE_DEVICES=0,1 timeout 100 $PYTEST tests/io/test_gpu_io_batch.py -k "not two_gpus_into_two_others" \
  > "$OUT/io_ab_test_batch.log" 2>&1 || rc=1
CUDA_VISIBLE_DEVICES=0,1 timeout 100 $PYTEST tests/io/test_gpu_io.py -k "$IO_XGMI and not xgmi_matrix" \
  > "$OUT/io_ab_test_xgmi.log" 2>&1 || rc=1
CUDA_VISIBLE_DEVICES=0,1 timeout 100 $PYTEST -s tests/integrations/sglang/test_gpu_pd_transfer.py -k "not four_gpus" \
  > "$OUT/io_ab_test_sglang.log" 2>&1 || rc=1
echo "tests: $((SECONDS - t0)) s"
for f in batch xgmi sglang; do
  echo "  $f: $(grep -E "[0-9]+ (passed|failed)" "$OUT/io_ab_test_$f.log" | tail -1)"
  grep -E "^FAILED|^ERROR" "$OUT/io_ab_test_$f.log" | head -5
done
fi
wait $BUILD
VARIANTS="new ref"
if [ -n "${BUILD2:-}" ]; then
  wait "$BUILD2"
  if [ "$(cat "$OUT/io_ab_newt_build.rc")" = 0 ]; then VARIANTS="new ref newt"; else tail -5 "$OUT/io_ab_newt_build.log"; fi
fi
if [ "$(cat "$OUT/io_ab_ref_build.rc")" != 0 ]; then
  tail -20 "$OUT/io_ab_ref_build.log"; echo "io_ab: the reference did not build"; exit 1
fi

bench() {  # bench NAME PYTHONPATH-prefix
  local name=$1 pre=$2
  PYTHONPATH="$pre${PYTHONPATH:-}" timeout 60 $PY -m mori_core.bench io --backend xgmi --op write --sizes '' --large '' \
    --pieces 8192x32K,64x8K --iters 20 --warmup 3 --breakdown --no-progress --initiator-device 0 --target-device 1 \
    > "$OUT/io_ab_io_$name.md" 2>&1 || { echo "io bench $name failed"; rc=1; }
  [ "${IO_AB_PD:-1}" = 1 ] || return 0
  PYTHONPATH="$pre${PYTHONPATH:-}" timeout 90 $PY -m mori_core.bench vllm-pd --agents --device cuda --iters 20 \
    --warmup 3 --block-order both --modes write,read --breakdown > "$OUT/io_ab_pd_$name.md" 2>&1 ||
    { echo "pd bench $name failed"; rc=1; }
}
prefix() { case $1 in ref) echo "$REFSITE:" ;; newt) echo "$NEWSITE:" ;; *) echo "" ;; esac; }
for r in $(seq 1 "$ROUNDS"); do
  # the order rotates from round to round (a variant is not always the one after the same other)
  vs=($VARIANTS); order=""
  for ((k = 0; k < ${#vs[@]}; k++)); do order="$order ${vs[$(( (k + r - 1) % ${#vs[@]} ))]}"; done
  for v in $order; do bench "$v$r" "$(prefix "$v")"; done
done

echo
echo "=== io_ab: engine A/B, GPU 0 -> 1 ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
for r in $(seq 1 "$ROUNDS"); do
  for v in $VARIANTS; do
    echo "--- $v, round $r: bench io"
    grep -E "^###|^\|" "$OUT/io_ab_io_$v$r.md" | grep -vE "^\|[-|]+\|$" | head -14
    [ -f "$OUT/io_ab_pd_$v$r.md" ] || continue
    echo "--- $v, round $r: bench vllm-pd --agents"
    grep -E "^###|^\|" "$OUT/io_ab_pd_$v$r.md" | grep -vE "^\|[-|]+\|$" | grep -vE "^\| +(write|read)," | head -14
  done
done
exit $rc
