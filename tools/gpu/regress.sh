#!/usr/bin/env bash
# GPU regression checks of the parts other changes reach indirectly (run after the suite is built):
#   omni     tests/integrations/vllm_omni/test_omni_gpu.py (CUDA pools over XGMI; the Omni connector's
#            control plane changed for issue #29: CURVE, recipient binding, pool pinning)
#   vllm     tests/integrations/vllm/test_vllm_gpu_exchange.py at EP2 and EP4 (the vLLM mori_ep
#            exchange over the GPU op, whose combine kernels changed for issue #31)
#   ep8      tests/ep/test_gpu_ep.py::test_ep_suite[8], two ranks per GPU on 4 GPUs (correctness only)
# Every step is bounded; a summary is printed last; exit 1 when one failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PYTEST="$PY -m pytest -q -rfs -p no:cacheprovider -o addopts="
SUMMARY="$OUT/regress_summary.txt"
: > "$SUMMARY"
rc=0
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --signal=KILL "$limit" bash -c "$*" > "$OUT/regress_$name.log" 2>&1
  local r=$?
  [ $r = 0 ] || rc=1
  printf '%-6s rc=%-3s %4ss  %s\n' "$name" "$r" "$((SECONDS - t0))" \
    "$(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/regress_$name.log" | tail -1)" | tee -a "$SUMMARY"
}
# omni (GPUs 0,1) and the vLLM exchange (GPUs 2,3 at EP2) side by side, then EP4 and EP8 on all four.
step omni_vllm2 100 "CUDA_VISIBLE_DEVICES=0,1 $PYTEST tests/integrations/vllm_omni/test_omni_gpu.py > $OUT/regress_omni.log 2>&1 & p=\$!;
  CUDA_VISIBLE_DEVICES=2,3 $PYTEST 'tests/integrations/vllm/test_vllm_gpu_exchange.py::test_token_exchange_over_gpu_op_matches_single_process_moe[2]'; r=\$?;
  wait \$p; o=\$?; tail -3 $OUT/regress_omni.log; [ \$r = 0 ] && [ \$o = 0 ]"
step vllm4 70 "$PYTEST 'tests/integrations/vllm/test_vllm_gpu_exchange.py::test_token_exchange_over_gpu_op_matches_single_process_moe[4]'"
step ep8 120 "MORI_RANKS_PER_GPU=2 $PYTEST 'tests/ep/test_gpu_ep.py::test_ep_suite[8]'"
echo "===== regress summary"; cat "$SUMMARY"
exit $rc
