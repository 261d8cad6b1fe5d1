# Bounded steps of a GPU section (a library, not a section: gpu_check.sh runs tools/gpu/*.sh only),
# sourced by tools/gpu/ep_deepep.sh, ep_fp8_ab.sh, ep_small_ab.sh and ep_internode.sh:
#   source "$(dirname "$0")/lib/budget_steps.sh"; section_start NAME BUDGET_SECONDS
# section_start sets what the steps use: BUDGET (seconds for the whole section), T0 (=$SECONDS at
# its start), OUT (the log folder), SUMMARY ($OUT/NAME_summary.txt, one line per step), and PY.

section_start() {  # section_start NAME BUDGET: the common start of a bounded section, run from the repo root
  set -u
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  OUT=${OUT:-$PWD/out}
  mkdir -p "$OUT"
  PY=${PYTHON:-python3}
  cd "$(dirname "$0")/../.." || exit 1
  BUDGET=$2
  T0=$SECONDS
  SUMMARY="$OUT/$1_summary.txt"
  : > "$SUMMARY"
}

left() { echo $(( BUDGET - (SECONDS - T0) )); }  # seconds of the section's budget still left

run() {  # run NAME LIMIT CMD...: CMD's output to $OUT/NAME.log, bounded by LIMIT and by what is left of the budget
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS cap
  cap=$(left); [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -le 5 ]; then printf '%-14s skipped (budget spent)\n' "$name" | tee -a "$SUMMARY"; return 124; fi
  echo "=== $name (limit ${limit}s): $*" > "$OUT/$name.log"
  timeout --signal=KILL "$limit" bash -c "$*" >> "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-14s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)" >> "$SUMMARY"
  return $rc
}
