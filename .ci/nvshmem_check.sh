#!/usr/bin/env bash
# Build check of the optional inter-node EP module (mori_core._internode) against NVSHMEM from
# PyPI. The CI machine has no GPU and no NVSHMEM install, so the wheel CI tests is built without
# this module; this compiles and links it (CUDA -rdc + libnvshmem_device.a + libnvshmem_host) so
# the sources cannot rot unnoticed. It runs nothing: the kernels need GPUs (tools/gpu/ep_internode.sh).
#
#   bash .ci/nvshmem_check.sh        (needs nvcc; NVSHMEM_WHEEL_VERSION overrides the pinned version)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then echo "nvshmem_check: nvcc not found, skipped"; exit 0; fi
VERSION=${NVSHMEM_WHEEL_VERSION:-3.4.5}   # the version on the GPU image
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q pybind11 cmake ninja
"$WORK/venv/bin/pip" download -q --no-deps -d "$WORK/dl" "nvidia-nvshmem-cu13==$VERSION"
(cd "$WORK" && python3 -m zipfile -e dl/*.whl pkg)
PREFIX="$WORK/pkg/nvidia/nvshmem"
"$WORK/venv/bin/cmake" -S . -B "$WORK/build" -G Ninja -DMORI_USE_CUDA=ON -DMORI_WITH_NVSHMEM=ON \
  -DNVSHMEM_HOME="$PREFIX" -DPython_EXECUTABLE="$WORK/venv/bin/python" \
  -Dpybind11_DIR="$("$WORK/venv/bin/python" -m pybind11 --cmakedir)" > "$WORK/configure.log" 2>&1 \
  || { tail -30 "$WORK/configure.log"; echo "nvshmem_check: configure FAILED"; exit 1; }
if "$WORK/venv/bin/cmake" --build "$WORK/build" --target _internode -j "$(nproc)" > "$WORK/build.log" 2>&1; then
  echo "nvshmem_check: OK (mori_core._internode built and linked against NVSHMEM $VERSION)"
else
  grep -E "error|Error" "$WORK/build.log" | head -30; echo "nvshmem_check: FAILED"; exit 1
fi
