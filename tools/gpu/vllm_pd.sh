#!/usr/bin/env bash
# GPU section of the vLLM PD connector (MoriSuiteConnector, issue 14).
#
#   bash tools/gpu/vllm_pd.sh       (run by tools/gpu_check.sh after it built and installed the suite)
#
# The GPU machine has no vLLM, so this runs the connector's worker side (TransferAgent: the
# code under MoriSuiteConnector's worker hooks) in separate processes with vLLM-style KV
# views on GPUs (two processes on GPU 0; and GPU 0 -> GPU 1 when there are 2 GPUs): 1. the
# test (bytes compared head by head; XGMI route asserted; WRITE
# layer-pipelined behind CUDA events; TP2 -> TP1), 2. the per-request transfer benchmark
# (32 layers x 8 KV heads x 128, bf16, 2048 tokens) next to a plain Tensor.copy_ between the
# same devices. With one GPU the multigpu test variant skips and the benchmark stays on GPU 0.
# Needs pyzmq and msgspec: tools/gpu_check.sh installs the wheels carried in .whl/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! $PY -c "import zmq, msgspec, mori_integrations.vllm.kv_connector.agent" 2>&1; then
  echo "vllm_pd: pyzmq/msgspec or the suite are not importable (see tools/gpu_check.sh)"
  exit 1
fi
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "vllm_pd: $ngpu GPU(s) visible; $([ "$ngpu" -ge 2 ] && echo "same-GPU and GPU0->GPU1 variants" || echo "same-GPU variant only")"
rc=0
t0=$(date +%s)
timeout 240 $PY -m pytest tests/integrations/vllm_pd/test_agent_gpu.py -q -rs -s -p no:cacheprovider --timeout 200 \
  2>&1 | tee "$OUT/vllm_pd_test.log"
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -ne 0 ] && rc=1
t1=$(date +%s)
timeout 150 $PY -m mori_core.bench vllm-pd --agents --device cuda --iters 20 2>&1 | tee "$OUT/bench_vllm_pd_cuda.md"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -ne 0 ] && rc=1
t2=$(date +%s)
echo
echo "| vllm_pd step | exit | seconds |"
echo "|---|---|---|"
echo "| test_agent_gpu.py | $test_rc | $((t1 - t0)) |"
echo "| bench vllm-pd --agents --device cuda | $bench_rc | $((t2 - t1)) |"
exit $rc
