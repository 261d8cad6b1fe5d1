#!/usr/bin/env bash
# Creates (or reuses) the virtual environment for the SGLang adapter tests:
# stock sglang==0.5.23 without its GPU dependency tree, on the CPU torch.
# Usage: .ci/venv_sglang.sh VENV_DIR
set -euo pipefail
V=${1:?usage: venv_sglang.sh VENV_DIR}
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import sglang.srt.disaggregation" 2>/dev/null; then exit 0; fi
python3 -m venv "$V"
"$V/bin/pip" install -q --upgrade pip
"$V/bin/pip" install -q torch==2.13.0
"$V/bin/pip" install -q --no-deps sglang==0.5.23
"$V/bin/pip" install -q orjson pybase64 triton packaging pillow starlette pydantic tqdm IPython aiohttp \
  transformers dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf pyzmq msgspec numpy \
  requests psutil pytest pytest-timeout
"$V/bin/python" -c "import sglang.srt.disaggregation.base.conn" 
