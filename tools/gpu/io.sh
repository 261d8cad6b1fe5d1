#!/usr/bin/env bash
# GPU section of MORI-IO (2 GPUs, ~3-4 min): the XGMI benchmark with the cost
# breakdown and kernel-shape sweep, two variants (copy engines for single
# writes; numpy offsets), the XGMI + TCP-with-GPU-memory tests, the TCP
# benchmarks, and last the XGMI summary table (latency, host time per call,
# baselines from the same run).
set -uo pipefail
rc=0
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
nvidia-smi topo -m 2>&1 | head -8 | tee "$OUT/io_topo.txt"
run() {  # run <name> <timeout s> <command...>: log to $OUT/<name>.md, never hang the section
  local name=$1 t=$2; shift 2
  echo "=== io: $name ($(date +%T))"
  if ! timeout "$t" "$@" > "$OUT/$name.md" 2>&1; then echo "io: $name FAILED or timed out (rc=$?)"; rc=1; fi
  tail -n 4 "$OUT/$name.md"
}
XGMI="python3 -m mori_core.bench io --backend xgmi --batch 64 --no-progress"
run bench_io_xgmi 90 $XGMI --sizes 8K,128K,1M --large 64M --iters 50 --breakdown --kernel-sweep
run bench_io_xgmi_ce_singles 45 env MORI_IO_XGMI_KERNEL_MIN_SEGMENTS=4 $XGMI --op write --sizes 8K,128K,1M --large '' --iters 50
run bench_io_xgmi_numpy 45 $XGMI --op write --arrays numpy --sizes 8K,128K,1M --large '' --iters 50
run bench_io_xgmi_piece32k 45 env MORI_IO_XGMI_PIECE_BYTES=32768 MORI_IO_XGMI_BLOCK_THREADS=512 $XGMI --op write --sizes 8K,128K,1M --large '' --iters 50
echo "=== io: pytest tests/io/test_gpu_io.py ($(date +%T))"
timeout 150 python3 -m pytest tests/io/test_gpu_io.py -q -p no:cacheprovider --timeout 120 -x -rf 2>&1 | tee "$OUT/test_gpu_io.log" | tail -n 25
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
run bench_io_tcp_gpu 45 python3 -m mori_core.bench io --backend tcp --mem gpu --op write --sizes 1M --batch 16 --large 256M --no-progress
echo
echo "=== io: summaries"
for f in bench_io_xgmi_ce_singles bench_io_xgmi_numpy bench_io_xgmi_piece32k; do
  echo "--- $f"; sed -n '/^### summary/,$p' "$OUT/$f.md"
done
sed -n '/^### where one session/,/^to C++/p;/^### scatter kernel shapes/,/^$/p' "$OUT/bench_io_xgmi.md" | head -60
sed -n '/^### write: latency per iteration/,$p' "$OUT/bench_io_xgmi.md" | sed -n '/^### write: latency/,/^backend/p'
sed -n '/^### summary/,$p' "$OUT/bench_io_xgmi.md"
exit $rc
