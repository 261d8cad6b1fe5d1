#!/usr/bin/env bash
# Creates (or reuses) the virtual environment for the SGLang adapter tests:
# stock sglang==0.5.23 without its GPU dependency tree, on torch 2.13.0, plus
# only what importing sglang.srt.disaggregation and the MoE token dispatchers
# (einops, openai, partial_json_parser: SGLang's create_moe_dispatcher for
# --moe-a2a-backend mori) need. The mori-suite wheel is
# installed into it separately (pip install --no-deps <wheel>).
# Usage: .ci/venv_sglang.sh VENV_DIR        (idempotent; ~1.5 min from scratch)
set -euo pipefail
V=${1:?usage: venv_sglang.sh VENV_DIR}
CHECK='import sglang.srt.disaggregation.common.conn, sglang.srt.layers.moe.fused_moe_triton.layer, msgspec, zmq, pytest_timeout'
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "$CHECK" 2>/dev/null; then exit 0; fi
[ -x "$V/bin/python" ] || python3 -m venv "$V"
PIP=("$V/bin/pip" install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0
# --no-deps: the wheel pins torch 2.14 and a CUDA kernel stack a CPU test never imports.
"${PIP[@]}" --no-deps sglang==0.5.23 torchvision==0.28.0
# Versions pinned where sglang 0.5.23 pins them.
"${PIP[@]}" orjson pybase64 triton packaging pillow starlette pydantic tqdm IPython aiohttp \
  transformers==5.19.0 dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 \
  gguf pyzmq msgspec numpy requests psutil pytest pytest-timeout \
  einops==0.8.2 openai==2.8.0 partial_json_parser==0.2.1.1.post7
# torchvision from PyPI is a CUDA build. Against a CPU torch its C++ ops cannot
# load, and 0.28 then fails at import on two unconditional fake-kernel
# registrations (torchvision::nms/qnms). sglang only needs torchvision's pure
# Python transforms at import time, so make those two registrations conditional
# on the ops being loaded. With a CUDA torch (PyPI in CI) the import works and
# nothing is touched.
if ! "$V/bin/python" -c "import torchvision" 2>/dev/null; then
  META=$("$V/bin/python" -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")/_meta_registrations.py
  sed -i 's/^@torch\.library\.register_fake(/@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda *a, **k: (lambda f: f)))(/' "$META"
fi
"$V/bin/python" -c "$CHECK; import sglang; print('sglang', sglang.__version__)"
