#!/usr/bin/env bash
# Prefill on GPU 0, decode on GPU 1, proxy on :8000 -- one node, KV over XGMI (CUDA IPC).
# Two nodes: run each server on its node, set "host_ip" in its extra config to the address
# the other node reaches, and point the proxy at both (KV then moves over RDMA, or TCP).
# Shared networks: add "auth_secret" (same value on both; or export MORI_IO_AUTH_SECRET).
set -euo pipefail
MODEL=${MODEL:?set MODEL to a model path or name}
DIR=$(cd "$(dirname "$0")" && pwd)
CUDA_VISIBLE_DEVICES=0 vllm serve "$MODEL" --port 8100 --kv-transfer-config "$(cat "$DIR/prefill.json")" &
CUDA_VISIBLE_DEVICES=1 vllm serve "$MODEL" --port 8200 --kv-transfer-config "$(cat "$DIR/decode.json")" &
python -m mori_integrations.vllm.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
  --prefill-ports 6301:61005 --mode write --port 8000
