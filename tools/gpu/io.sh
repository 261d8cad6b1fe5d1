#!/usr/bin/env bash
# GPU section of MORI-IO: XGMI + TCP-with-GPU-memory tests, then the IO benchmarks.
set -uo pipefail
rc=0
python3 -m pytest tests/io/test_gpu_io.py -q -p no:cacheprovider --timeout 900 || rc=1
python3 -m mori_core.bench io --backend xgmi --sizes 8K,128K,1M --batch 64 --large 64M --iters 50 --no-progress \
  | tee "$OUT/bench_io_xgmi.md" || rc=1
python3 -m mori_core.bench io --backend tcp --mem gpu --op write --sizes 1M --batch 16 --large 256M --no-progress \
  | tee "$OUT/bench_io_tcp_gpu.md" || rc=1
python3 -m mori_core.bench io --backend tcp --no-progress | tee "$OUT/bench_io_tcp_cpu.md" || rc=1
exit $rc
