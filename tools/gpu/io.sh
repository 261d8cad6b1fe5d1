#!/usr/bin/env bash
# GPU section of MORI-IO (~5 min on 2 GPUs, ~3 min on 1): the XGMI benchmark
# with the cost breakdown, a one-stream variant, the copy-proxy variants, the XGMI + TCP-with-GPU-memory
# tests, the TCP-with-GPU-memory benchmark, and last the XGMI summary table
# (latency, host time per call, same-run baselines).
# With one GPU the XGMI benchmark runs between two processes on that GPU (CUDA
# IPC to the same device: the full host path and completion mechanics, no
# NVLink), and the tests' two-GPU cases skip.
set -uo pipefail
rc=0
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
tdev=$(( ngpu >= 2 ? 1 : 0 ))
echo "io: $ngpu GPU(s); XGMI benchmark GPU 0 -> GPU $tdev" | tee "$OUT/io_setup.txt"
nvidia-smi topo -m 2>&1 | head -6 >> "$OUT/io_setup.txt"
run() {  # run <name> <timeout s> <command...>: output to $OUT/<name>.md; a stage never hangs the section
  local name=$1 t=$2; shift 2
  echo "=== io: $name ($(date +%T))"
  timeout "$t" "$@" > "$OUT/$name.md" 2>&1
  local r=$?
  [ $r = 0 ] || { echo "io: $name FAILED or timed out (rc=$r)"; tail -n 30 "$OUT/$name.md"; rc=1; }
}
XGMI="python3 -m mori_core.bench io --backend xgmi --batch 64 --target-device $tdev --no-progress"
run bench_io_xgmi 100 $XGMI --sizes 8K,128K,1M --large 64M --iters 50 --breakdown
run bench_io_xgmi_1stream 45 $XGMI --op write --sizes 8K,128K --large '' --iters 50 --xgmi-streams 1
# The resident copy proxy (opt-in): same matrix, transfers <= 1 MiB / 64 segments skip the launch.
for pb in ${IO_PROXY_BLOCKS:-8 16}; do
  run bench_io_xgmi_proxy$pb 100 $XGMI --sizes 8K,128K,1M --large '' --iters 50 --breakdown --xgmi-proxy-blocks $pb
done
echo "=== io: pytest tests/io/test_gpu_io.py ($(date +%T))"
timeout 300 python3 -m pytest tests/io/test_gpu_io.py -q -p no:cacheprovider --timeout 120 -rfs 2>&1 \
  | tee "$OUT/test_gpu_io.log" | grep -v "^SKIPPED" | tail -n 25
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
run bench_io_tcp_gpu 45 python3 -m mori_core.bench io --backend tcp --mem gpu --op write --sizes 1M --batch 16 \
  --large 256M --target-device $tdev --no-progress
echo
echo "=== io: results"
# Tables are "### title", blank line, rows, blank line, note: print each up to its note.
echo "--- TCP with GPU memory"; sed -n '/^### one large write/,/^backend/p;/^### summary/,/^plain copy/p' "$OUT/bench_io_tcp_gpu.md"
echo "--- XGMI, one stream"; sed -n '/^### summary/,/^plain copy/p' "$OUT/bench_io_xgmi_1stream.md"
echo "--- XGMI"; cat "$OUT/io_setup.txt" | head -1
sed -n '/^### write: latency per iteration/,/^backend/p;/^### one large write/,/^backend/p' "$OUT/bench_io_xgmi.md"
sed -n '/^### where one session/,/^to C++/p' "$OUT/bench_io_xgmi.md"
sed -n '/^### summary/,$p' "$OUT/bench_io_xgmi.md"
for pb in ${IO_PROXY_BLOCKS:-8 16}; do
  echo "--- XGMI + copy proxy of $pb blocks"
  sed -n '/^### where one session/,/^to C++/p' "$OUT/bench_io_xgmi_proxy$pb.md"
  sed -n '/^### summary/,$p' "$OUT/bench_io_xgmi_proxy$pb.md"
done
exit $rc
