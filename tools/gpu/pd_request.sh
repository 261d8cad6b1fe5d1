#!/usr/bin/env bash
# GPU section: the vLLM PD connector's per-request host path (issue 27), against a reference.
# Budget: ~150 s on 2 or 4 GPUs.
#
#   PD_REF_DIR=.ref bash tools/gpu_check.sh pd_request
#
# PD_REF_DIR (optional) is a folder holding another version's `mori_integrations` package
# (e.g. `git archive <commit> integrations | tar -x -C .ref && mv .ref/integrations
# .ref/mori_integrations`): the benchmark then also runs with that adapter code in front of the
# installed one, on the same machine, between two runs of this tree's code (new, ref, new).
#
# A. tests/integrations/vllm_pd/test_agent_gpu.py (real agents over XGMI in two processes: same
#    GPU on GPUs 2,3; two GPUs on GPUs 0,1), both halves at once.
# B. python -m mori_core.bench vllm-pd --agents (vLLM: WRITE, READ, layer-pipelined WRITE; contiguous
#    and scattered blocks; per-phase breakdown; SGLang: one chunk) GPU 0 -> 1, alone on the host, next
#    to a same-run Tensor.copy_. Same-run A/B of the lead split: extra vLLM rows with lead_layers=0,
#    SGLang rows with the chunk in one batch_write (between two default runs). PD_ROUNDS (default 2)
#    repeats the whole bench to show the spread between runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
rc=0
PYTEST="$PY -m pytest -v --tb=short -rfs -p no:cacheprovider --timeout 45 --durations=5"

# ---- A: correctness over XGMI (the control-thread write and model-thread read run here)
g2=$(( ngpu >= 4 ? 2 : 0 )),$(( ngpu >= 4 ? 3 : 1 ))
(CUDA_VISIBLE_DEVICES=0,1 timeout 60 $PYTEST -s tests/integrations/vllm_pd/test_agent_gpu.py -k two-gpus \
   > "$OUT/pd_request_A_two_gpus.log" 2>&1; echo $? > "$OUT/pd_request_A_two_gpus.rc") &
if [ "$ngpu" -lt 4 ]; then wait; fi
(CUDA_VISIBLE_DEVICES=$g2 timeout 60 $PYTEST -s tests/integrations/vllm_pd/test_agent_gpu.py -k same-gpu \
   > "$OUT/pd_request_A_same_gpu.log" 2>&1; echo $? > "$OUT/pd_request_A_same_gpu.rc") &
wait
for t in two_gpus same_gpu; do
  r=$(cat "$OUT/pd_request_A_$t.rc"); [ "$r" = 0 ] || rc=1
  echo "--- A $t (exit $r): $(grep -E "^=+ .*(passed|failed|error).* in " "$OUT/pd_request_A_$t.log" | tail -n 1)"
  grep -E "FAILED|ERROR|Timeout" "$OUT/pd_request_A_$t.log" | head -n 8
done

# ---- B: the request benchmark, alone on the host (new; ref and new again with PD_REF_DIR)
bench() {  # $1: label, $2: extra PYTHONPATH in front ("" = this tree)
  local t=$(date +%s)
  PYTHONPATH=${2:+$2:}${PYTHONPATH:-} CUDA_VISIBLE_DEVICES=0,1 timeout 240 $PY -m mori_core.bench vllm-pd --agents \
    --device cuda --frameworks vllm,sglang --iters 30 --warmup 3 --block-order both --breakdown \
    --connector-config "lead_layers=0" --sglang-one-call \
    > "$OUT/pd_request_B_$1.md" 2>&1
  local r=$?; [ "$r" = 0 ] || rc=1
  echo "--- B $1 (exit $r, $(( $(date +%s) - t )) s)"
}
bench new ""
for i in $(seq 2 "${PD_ROUNDS:-2}"); do bench "new$i" ""; done
if [ -n "${PD_REF_DIR:-}" ]; then
  PYTHONPATH=$PD_REF_DIR${PYTHONPATH:+:$PYTHONPATH} $PY -c "import mori_integrations, sys; print('ref adapters:', mori_integrations.__file__)"
  bench ref "$(cd "$PD_REF_DIR" && pwd)"
  bench new2 ""
fi
echo
for f in "$OUT"/pd_request_B_*.md; do
  echo "=== phases: $(basename "$f")"
  grep -v "^$" "$f" | grep -E "^\|.*(write|read|pipelined), |Error|error|Traceback" | tail -n 40
done
echo
for f in "$OUT"/pd_request_B_*.md; do  # the request rows last (what the tool's output tail keeps)
  echo "=== requests: $(basename "$f")"
  grep -E "MoriSuiteConnector|SGLang PD chunk \(|plain copy|Traceback" "$f"
done
echo "pd_request: total $(( $(date +%s) - T0 )) s"
exit $rc
