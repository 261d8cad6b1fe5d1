#!/usr/bin/env bash
# GPU section of the vLLM-Omni connector (issue 7, items 5 and 6).
#
#   bash tools/gpu/omni.sh          (run by tools/gpu_check.sh after it built and installed the suite)
#
# The GPU machine has no vLLM / vLLM-Omni, so this runs the connector's data path
# (mori_integrations.vllm_omni.transport, the code under MoriTransferEngineConnector
# put/get) in two processes on two GPUs with CUDA pools, then seed 004's benchmark
# table over XGMI (auto route) and TCP, and over CPU pools (TCP).
# Needs pyzmq and msgspec: tools/gpu_check.sh installs the wheels carried in .whl/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! $PY -c "import zmq, msgspec" 2>/dev/null; then
  echo "omni: pyzmq and msgspec are not importable; carry their cp312 wheels in .whl/ (see tools/gpu_check.sh)"
  exit 1
fi
rc=0
$PY -m pytest tests/integrations/vllm_omni/test_omni_gpu.py -q -rs -p no:cacheprovider --timeout 900 || rc=1
$PY -m mori_core.bench omni --device cuda --iters 100 | tee "$OUT/bench_omni_cuda.md" || rc=1
$PY -m mori_core.bench omni --device cuda --sizes 67108864 --payloads tensor --iters 20 \
  | tee "$OUT/bench_omni_cuda_64m.md" || rc=1
$PY -m mori_core.bench omni --device cpu --iters 100 | tee "$OUT/bench_omni_cpu.md" || rc=1
exit $rc
