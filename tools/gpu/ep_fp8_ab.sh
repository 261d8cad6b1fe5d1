#!/usr/bin/env bash
# FP8 combine codec, same-run A/B on the 4-GPU machine (issue #31, round 6).
#
#   bash tools/gpu_check.sh ep_fp8_ab            (or: bash tools/gpu/ep_fp8_ab.sh, suite installed)
#
# The installed build (the default: hardware e4m3 conversion, MORI_EP_FP8_UNROLL 8) runs the
# FP8-combine and standard-MoE suite at EP4 (tests/ep/test_gpu_ep_extensions.py, with the codec
# cases that send every bf16 value through the device's encode and decode). Meanwhile two variants
# build into folders of their own (CMAKE_ARGS, `pip install --target`):
#   soft   -DMORI_EP_FP8_SOFT_CODEC     the software codec (what ran before)
#   hw16   -DMORI_EP_FP8_UNROLL=16      hardware conversion, 16/world vectors per lane in flight
# Then, alone on the host, `bench ep --fp8-combine` at EP4 runs default, soft, hw16, twice in turn
# (AB_FP8_ROUNDS), and a table of the combine rows (eager median us) per variant is printed last.
# Every step is bounded; the whole section by AB_FP8_BUDGET seconds.
# shellcheck source=tools/gpu/lib/budget_steps.sh
source "$(dirname "$0")/lib/budget_steps.sh"
section_start ep_fp8_ab "${AB_FP8_BUDGET:-420}"
ROUNDS=${AB_FP8_ROUNDS:-2}

declare -A FLAGS=([soft]="-DMORI_EP_FP8_SOFT_CODEC" [hw16]="-DMORI_EP_FP8_UNROLL=16")
declare -A BUILD_PID
for v in soft hw16; do
  rm -rf "/tmp/v_$v"
  ( timeout --signal=KILL 240 env CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=${FLAGS[$v]}" CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 4 + 1 )) \
      MORI_CUDA_ARCH=90 $PY -m pip install -v --no-build-isolation --no-deps --no-compile -Cbuild.verbose=true \
      --target "/tmp/v_$v" . \
      > "$OUT/build_$v.log" 2>&1; echo $? > "/tmp/v_$v.rc" ) &
  BUILD_PID[$v]=$!
done

run ep4_ext 150 "$PY -m pytest -q -rs -p no:cacheprovider -o addopts='' -s 'tests/ep/test_gpu_ep_extensions.py::test_standard_moe_and_fp8_combine[4]'"

variants=(default)
for v in soft hw16; do
  wait "${BUILD_PID[$v]}"
  rc=$(cat "/tmp/v_$v.rc" 2>/dev/null || echo 1)
  # the flag must have reached the compiler of the FP8 combine (build.verbose prints each command)
  seen=$(grep -c -- "${FLAGS[$v]}.*ep_combine_fp8" "$OUT/build_$v.log")
  printf 'build %-5s rc=%s, compile lines with %s: %s\n' "$v" "$rc" "${FLAGS[$v]}" "$seen" | tee -a "$SUMMARY"
  # a variant whose flag is not seen still runs: its times then tell whether the flag took effect
  [ "$rc" = 0 ] && variants+=("$v")
done

BENCH="MORI_SHMEM_HEAP_SIZE=8G $PY -m mori_core.bench ep --world-size 4 --tokens 512,4096 --dtypes bf16 --auto --iters 10 --eager-calls 30 --no-nccl --no-graph --fp8-combine"
for i in $(seq 1 "$ROUNDS"); do
  for v in "${variants[@]}"; do
    path=""; [ "$v" != default ] && path="/tmp/v_$v:"
    run "bench_${v}_$i" 70 "PYTHONPATH=$path\${PYTHONPATH:-} $BENCH --json $OUT/ab_${v}_$i.json"
  done
done

echo; echo "===== ep_fp8_ab ($(nvidia-smi -L 2>/dev/null | wc -l) GPU(s), $((SECONDS - T0)) s of $BUDGET s)"
cat "$SUMMARY"
[ -f "$OUT/ep4_ext.log" ] && grep -E "^\[rank 0\] (PASS|FAIL)|^  " "$OUT/ep4_ext.log" | head -60
$PY - "$OUT" <<'EOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
cells = {}
for path in sorted(glob.glob(os.path.join(out, "ab_*_*.json"))):
    variant = os.path.basename(path)[3:].rsplit("_", 1)[0]
    for r in json.load(open(path))["rows"]:
        if r.get("ext") != "fp8":
            continue
        key = (r["tokens"], r["kernel"], r["mode"])
        cells.setdefault(key, {}).setdefault(variant, []).append(r.get("eager_us") or r["us"])
names = ["default", "soft", "hw16"]
print("\n### FP8 combine codec A/B, EP4, eager median us per run (runs in turn)")
print("| tokens | combine | mode | " + " | ".join(names) + " | soft / default |")
print("|---|---|---|" + "---|" * len(names) + "---|")
for key in sorted(cells):
    c = cells[key]
    med = {n: statistics.median(c[n]) for n in names if n in c}
    ratio = f"{med['soft'] / med['default']:.2f}x" if "soft" in med and "default" in med else "-"
    print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(
        " / ".join(f"{u:.1f}" for u in c.get(n, [])) or "-" for n in names) + f" | {ratio} |")
EOF
grep -qE "^ep4_ext +rc=0 " "$SUMMARY"
