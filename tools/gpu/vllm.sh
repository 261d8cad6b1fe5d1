#!/usr/bin/env bash
# GPU-machine section of the vLLM adapter (mori_ep). vLLM is NOT needed here: it checks
# the adapter's dispatch/combine logic over the core GPU operator and measures one MoE layer.
#   1. tests/integrations/vllm/test_vllm_gpu_exchange.py on 2 and 4 GPUs (no vLLM import)
#   2. python -m mori_core.bench moe on 2 and 4 GPUs (BF16, then FP8 dispatch) with the
#      single-GPU baseline, at 128 / 512 / 4096 tokens per rank
# Usage (repository root, suite installed in the current Python): tools/gpu/vllm.sh
# Env: PYTHON (default python3), MOE_BENCH_ARGS (extra args for both benchmark runs).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
status=0

if ! "$PY" -c "import mori_core.ops, mori_integrations.vllm.token_exchange" 2>/dev/null; then
  echo "vllm.sh: mori-suite is not installed in $PY (pip install --no-build-isolation --no-deps .)" >&2
  exit 2
fi
"$PY" -c "import mori_core; print('mori_core build:', mori_core.build_info())"

echo "== vllm adapter: token exchange over EpDispatchCombineOp (2 and 4 GPUs) =="
timeout 900 "$PY" -m pytest -q -rs -p no:cacheprovider tests/integrations/vllm/test_vllm_gpu_exchange.py || status=1

echo "== MoE layer benchmark (BF16 dispatch) =="
timeout 1200 "$PY" -m mori_core.bench moe --world-sizes 2,4 --tokens 128,512,4096 ${MOE_BENCH_ARGS:-} || status=1

echo "== MoE layer benchmark (FP8 dispatch) =="
timeout 1200 "$PY" -m mori_core.bench moe --world-sizes 2,4 --tokens 128,512,4096 --fp8-dispatch --no-baseline \
  ${MOE_BENCH_ARGS:-} || status=1

exit $status
