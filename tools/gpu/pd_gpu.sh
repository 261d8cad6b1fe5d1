#!/usr/bin/env bash
# GPU section of issue 27 (final run): KV transfer between GPUs at copy-engine speed (IO many-piece
# batches, the vLLM PD connector's worker side, the SGLang PD adapter's chunk path).
# Budget: 115 s on 4 GPUs (the section stops itself at PD_GPU_BUDGET_S=108 s of its own).
#
#   bash tools/gpu_check.sh pd_gpu      (after gpu_check.sh built and installed the suite)
#
# A. correctness, every test process at once (timings are not taken here; GPUs are shared):
#    GPUs 0,1: tests/io/test_gpu_io_batch.py (64 region pairs in one batch, 8,192 scattered pieces,
#              mixed batch, grid settings); tests/io/test_gpu_io.py's 2-GPU XGMI cases in three parts
#              (launch path) plus the copy proxy's multi-segment cases; the SGLang PD 2-GPU test;
#    GPUs 2,3: tests/integrations/vllm_pd/test_agent_gpu.py in two halves (same GPU, two GPUs);
#    GPUs 0-3: the 4-GPU tests (one batch from 2 GPUs into 2 others; SGLang TP2 -> TP2 and TP2 -> TP1).
# C. benchmarks, each beside a same-run baseline, on disjoint GPU pairs at the same time
#    (one process per GPU; NVSwitch gives each pair its own links):
#    C1 GPU 0 -> 1: python -m mori_core.bench vllm-pd --agents: vLLM WRITE / READ / layer-pipelined WRITE
#       and the SGLang chunk, contiguous and scattered blocks, per-phase breakdown, next to Tensor.copy_;
#    C2 GPU 2 -> 3: python -m mori_core.bench io --pieces 8192x32K,64x8K,64x128K: session and 64-pair
#       batch_write beside copy engines per piece, cudaMemcpyBatchAsync, a contiguous copy_ and the
#       kernel alone; host-time breakdown; two engine settings (the copy proxy for 64 x 8 KiB, 32 KiB pieces).
# Every stage has a timeout that keeps the section inside its budget; logs and tables go to $OUT;
# the final tables print last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mori_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BUDGET=${PD_GPU_BUDGET_S:-108}
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
PYTEST="$PY -m pytest -v --tb=short -rfs -p no:cacheprovider --timeout 45 --durations=5"  # -v: a killed run still shows each result

# ---- A: all correctness tests at once. name|GPUs|files|-k expression
IO_XGMI="not 1gpu and not proxy and not tcp_backend"
TESTS4=(
  "io_batch|0,1|tests/io/test_gpu_io_batch.py|not two_gpus_into_two_others"
  "io_xgmi_write|0,1|tests/io/test_gpu_io.py|$IO_XGMI and xgmi_matrix and write"
  "io_xgmi_read|0,1|tests/io/test_gpu_io.py|$IO_XGMI and xgmi_matrix and read"
  "io_xgmi_other|0,1|tests/io/test_gpu_io.py|$IO_XGMI and not xgmi_matrix"
  "io_proxy|0,1|tests/io/test_gpu_io.py|2gpu-proxy and (batch or scattered or segments)"
  "sglang_2gpu|0,1|-s tests/integrations/sglang/test_gpu_pd_transfer.py|not four_gpus"
  "vllm_same_gpu|2,3|-s tests/integrations/vllm_pd/test_agent_gpu.py|same-gpu"
  "vllm_two_gpus|2,3|-s tests/integrations/vllm_pd/test_agent_gpu.py|two-gpus"
  "four_gpus|0,1,2,3|tests/io/test_gpu_io_batch.py tests/integrations/sglang/test_gpu_pd_transfer.py|four_gpus or two_gpus_into_two_others"
)
# (the vllm_pd and sglang test folders both have a pd_cluster.py on sys.path: never one pytest for both)
tA=$(date +%s)
capA=$(cap 52)
for t in "${TESTS4[@]}"; do
  IFS='|' read -r name gpus files kexpr <<< "$t"
  if [ "$ngpu" -lt 4 ]; then
    [ "$name" = four_gpus ] && continue
    gpus=0,1
  fi
  # shellcheck disable=SC2086  # $files: pytest arguments separated by spaces
  (CUDA_VISIBLE_DEVICES=$gpus timeout "$capA" $PYTEST $files -k "$kexpr" \
     > "$OUT/pd_gpu_A_$name.log" 2>&1; echo $? > "$OUT/pd_gpu_A_$name.rc") &
done
wait
for t in "${TESTS4[@]}"; do
  name=${t%%|*}
  [ -f "$OUT/pd_gpu_A_$name.rc" ] || continue
  record "A $name" "$(cat "$OUT/pd_gpu_A_$name.rc")" $(( $(date +%s) - tA ))
done

# ---- C: the two benchmarks at once on disjoint GPU pairs (C2 after C1 with fewer than 4 GPUs)
tC=$(date +%s)
capC=$(cap 40)
(timeout "$capC" $PY -m mori_core.bench vllm-pd --agents --device cuda --iters 20 --warmup 3 --block-order both \
   --breakdown > "$OUT/pd_gpu_bench_pd.md" 2>&1; echo $? > "$OUT/pd_gpu_C1.rc") &
if [ "$ngpu" -lt 4 ]; then wait; fi
c2i=$(( ngpu >= 4 ? 2 : 0 )); c2t=$(( ngpu >= 4 ? 3 : 1 ))
(timeout "$(cap 40)" $PY -m mori_core.bench io --backend xgmi --op write --sizes '' --large '' \
   --pieces 8192x32K,64x8K,64x128K --iters 20 --warmup 3 --breakdown --no-progress \
   --initiator-device $c2i --target-device $c2t \
   --xgmi-sweep "MORI_IO_XGMI_PROXY_BLOCKS=8;MORI_IO_XGMI_PIECE_BYTES=32K" \
   > "$OUT/pd_gpu_bench_io.md" 2>&1; echo $? > "$OUT/pd_gpu_C2.rc") &
wait
record "C1 bench vllm-pd --agents, GPU 0 -> 1 (vLLM + SGLang)" "$(cat "$OUT/pd_gpu_C1.rc")" $(( $(date +%s) - tC ))
record "C2 bench io --pieces, GPU $c2i -> $c2t" "$(cat "$OUT/pd_gpu_C2.rc")" $(( $(date +%s) - tC ))

echo
echo "=== pd_gpu: tests"
for t in "${TESTS4[@]}"; do
  name=${t%%|*}
  [ -f "$OUT/pd_gpu_A_$name.log" ] || continue
  echo "--- $name: $(grep -E "^=+ .*(passed|failed|error).* in " "$OUT/pd_gpu_A_$name.log" | tail -n 1)"
  grep -E "FAILED|ERROR|Timeout" "$OUT/pd_gpu_A_$name.log" | head -n 8
done
echo
echo "=== pd_gpu: results"
grep -h "^\[io --pieces\]" "$OUT/pd_gpu_bench_io.md" | tail -n 6
for f in pd_gpu_bench_io pd_gpu_bench_pd; do
  echo "--- $f"; grep -v "^$" "$OUT/$f.md" | grep -E "^\||^###|Error|error|Traceback" | tail -n 60
done
echo
echo "| pd_gpu stage | exit | seconds |"
echo "|---|---|---|"
for i in "${!NAMES[@]}"; do echo "| ${NAMES[$i]} | ${RCS[$i]} | ${SECS[$i]} |"; done
echo "pd_gpu: total $(( $(date +%s) - T0 )) s"
exit $rc
