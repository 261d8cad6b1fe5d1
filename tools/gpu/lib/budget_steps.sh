# Bounded steps of a GPU section (a library, not a section: gpu_check.sh runs tools/gpu/*.sh only),
# sourced by tools/gpu/ep_deepep.sh and tools/gpu/ep_fp8_ab.sh.
# The sourcing script sets BUDGET (seconds for the whole section), T0 (=$SECONDS at its start),
# OUT (the log folder) and SUMMARY (a file that gets one line per step).

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
