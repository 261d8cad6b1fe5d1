#!/usr/bin/env bash
# GPU section of issue 27: KV transfer between GPUs at copy-engine speed (IO many-piece batches,
# the vLLM PD connector's worker side, the SGLang PD adapter's chunk path). Budget: 130 s on 4 GPUs.
#
#   bash tools/gpu_check.sh pd_gpu      (after gpu_check.sh built and installed the suite)
#
# A. correctness, two pairs of GPUs at once (timings are not taken here):
#    GPUs 0,1: tests/io/test_gpu_io_batch.py (64 region pairs in one batch, 8,192 scattered pieces,
#              mixed batch, grid settings) + tests/io/test_gpu_io.py's XGMI cases on 2 GPUs;
#    GPUs 2,3: tests/integrations/vllm_pd/test_agent_gpu.py + tests/integrations/sglang/test_gpu_pd_transfer.py.
# B. correctness on 4 GPUs: one batch from 2 GPUs into 2 others; SGLang TP2 -> TP2 and TP2 -> TP1.
# C. benchmarks, alone on the machine, each beside a same-run baseline:
#    C1 python -m mori_core.bench vllm-pd --agents: vLLM WRITE / READ / layer-pipelined WRITE and the SGLang
#       chunk, contiguous and scattered blocks, with the per-phase breakdown, next to Tensor.copy_;
#       plus one more vLLM pair with the kernel forced for 8 MiB segments (KERNEL_MAX_AVG_BYTES=64M);
#    C2 python -m mori_core.bench io --pieces 8192x32K,64x8K,64x128K: session and 64-pair batch_write
#       beside copy engines per piece, cudaMemcpyBatchAsync, a contiguous copy_ and the kernel alone;
#       host-time breakdown; the kernel-setting sweep (MORI_IO_XGMI_MAX_BLOCKS / PIECE_BYTES / BLOCK_THREADS).
# Every stage has a timeout that also keeps the section inside its budget; logs and tables go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BUDGET=${PD_GPU_BUDGET_S:-128}
T0=$(date +%s)
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "pd_gpu: $ngpu GPU(s), budget ${BUDGET}s" | tee "$OUT/pd_gpu_setup.txt"
nvidia-smi topo -m 2>&1 | head -6 >> "$OUT/pd_gpu_setup.txt"
if ! $PY -c "import zmq, msgspec, mori_integrations.vllm.kv_connector.agent, mori_integrations.sglang.prefill_transfer"; then
  echo "pd_gpu: pyzmq/msgspec or the suite are not importable (see tools/gpu_check.sh)"; exit 1
fi
declare -a NAMES RCS SECS
rc=0
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local want=$1 l; l=$(left); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
record() { NAMES+=("$1"); RCS+=("$2"); SECS+=("$3"); [ "$2" = 0 ] || rc=1; }
PYTEST="$PY -m pytest -v --tb=short -rfs -p no:cacheprovider --timeout 60"  # -v: a killed run still shows each result

# ---- A: correctness, GPUs 0,1 and GPUs 2,3 at the same time
tA=$(date +%s)
if [ "$ngpu" -ge 4 ]; then
  capA=$(cap 55)
  (CUDA_VISIBLE_DEVICES=0,1 timeout "$capA" $PYTEST tests/io/test_gpu_io_batch.py tests/io/test_gpu_io.py \
     -k "not four_gpus and not two_gpus_into_two_others and not tcp_backend and not 1gpu" \
     > "$OUT/pd_gpu_A_io.log" 2>&1; echo $? > "$OUT/pd_gpu_A_io.rc") &
  # (two pytest runs: the vllm_pd and sglang test folders both have a pd_cluster.py on sys.path)
  (export CUDA_VISIBLE_DEVICES=2,3; end=$(( $(date +%s) + capA ))
   timeout "$capA" $PYTEST -s tests/integrations/vllm_pd/test_agent_gpu.py > "$OUT/pd_gpu_A_pd.log" 2>&1; r1=$?
   timeout $(( end - $(date +%s) > 1 ? end - $(date +%s) : 1 )) $PYTEST -s tests/integrations/sglang/test_gpu_pd_transfer.py \
     -k "not four_gpus" >> "$OUT/pd_gpu_A_pd.log" 2>&1; r2=$?
   echo $(( r1 | r2 )) > "$OUT/pd_gpu_A_pd.rc") &
  wait
  record "A io tests (GPUs 0,1)" "$(cat "$OUT/pd_gpu_A_io.rc")" $(( $(date +%s) - tA ))
  record "A vLLM + SGLang PD tests (GPUs 2,3)" "$(cat "$OUT/pd_gpu_A_pd.rc")" $(( $(date +%s) - tA ))
else  # 2 GPUs: one after the other
  timeout "$(cap 40)" $PYTEST tests/io/test_gpu_io_batch.py tests/io/test_gpu_io.py \
    -k "not tcp_backend and not 1gpu" > "$OUT/pd_gpu_A_io.log" 2>&1
  record "A io tests" $? $(( $(date +%s) - tA )); tA=$(date +%s)
  timeout "$(cap 30)" $PYTEST -s tests/integrations/vllm_pd/test_agent_gpu.py > "$OUT/pd_gpu_A_pd.log" 2>&1
  record "A vLLM PD tests" $? $(( $(date +%s) - tA )); tA=$(date +%s)
  timeout "$(cap 25)" $PYTEST -s tests/integrations/sglang/test_gpu_pd_transfer.py >> "$OUT/pd_gpu_A_pd.log" 2>&1
  record "A SGLang PD tests" $? $(( $(date +%s) - tA ))
fi
for f in pd_gpu_A_io pd_gpu_A_pd; do echo "--- $f"; grep -E " passed| failed| error|FAILED|ERROR|Timeout" "$OUT/$f.log" | tail -n 12; done

# ---- B: correctness on 4 GPUs
if [ "$ngpu" -ge 4 ]; then
  tB=$(date +%s)
  timeout "$(cap 28)" $PYTEST tests/io/test_gpu_io_batch.py tests/integrations/sglang/test_gpu_pd_transfer.py \
    -k "four_gpus or two_gpus_into_two_others" > "$OUT/pd_gpu_B.log" 2>&1
  record "B 4-GPU tests" $? $(( $(date +%s) - tB ))
  echo "--- pd_gpu_B"; grep -E " passed| failed| error|FAILED|ERROR|Timeout" "$OUT/pd_gpu_B.log" | tail -n 8
fi

# ---- C1: the PD request benchmark (vLLM WRITE / READ / pipelined, SGLang chunk) beside Tensor.copy_
tC=$(date +%s)
timeout "$(cap 38)" $PY -m mori_core.bench vllm-pd --agents --device cuda --iters 20 --warmup 3 --block-order both \
  --breakdown --engine-env "MORI_IO_XGMI_KERNEL_MAX_AVG_BYTES=64M" > "$OUT/pd_gpu_bench_pd.md" 2>&1
record "C1 bench vllm-pd --agents (vLLM + SGLang)" $? $(( $(date +%s) - tC ))

# ---- C2: many-piece IO rows beside copy-engine baselines, breakdown, kernel-setting sweep
tC=$(date +%s)
timeout "$(cap 32)" $PY -m mori_core.bench io --backend xgmi --op write --sizes '' --large '' \
  --pieces 8192x32K,64x8K,64x128K --iters 20 --warmup 3 --breakdown --xgmi-sweep --no-progress \
  > "$OUT/pd_gpu_bench_io.md" 2>&1
record "C2 bench io --pieces (+ sweep)" $? $(( $(date +%s) - tC ))

echo
echo "=== pd_gpu: results"
for f in pd_gpu_bench_io pd_gpu_bench_pd; do
  echo "--- $f"; grep -v "^$" "$OUT/$f.md" | grep -E "^\||^###|Error|error|Traceback" | tail -n 60
done
echo
echo "| pd_gpu stage | exit | seconds |"
echo "|---|---|---|"
for i in "${!NAMES[@]}"; do echo "| ${NAMES[$i]} | ${RCS[$i]} | ${SECS[$i]} |"; done
echo "pd_gpu: total $(( $(date +%s) - T0 )) s"
exit $rc
