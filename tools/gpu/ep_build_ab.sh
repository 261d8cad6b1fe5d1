#!/usr/bin/env bash
# Same-run A/B of the EP kernels against an earlier tree (issue #31, round 9: the dispatch's completion).
#
#   bash tools/gpu_check.sh ep_build_ab
#
# EP_REF_DIR (default .ref_engine, carried): the earlier sources, e.g.
#   rm -rf .ref_engine && mkdir .ref_engine && git archive <commit> | tar -x -C .ref_engine
# They build into a folder of their own (pip --target) while this tree's EP GPU tests run on the
# installed build (EP_AB_TESTS: pytest arguments; default the EP4 suite, the FP8/standard-MoE suite
# at EP4, the timeout test and the mixed-combine-kinds test). Then
# `bench ep` (EP_AB_BENCH) runs the reference and this build in turn, EP_AB_ROUNDS times, at each
# of EP_AB_WORLDS (EP2 on GPUs 0,1), and a table of the dispatch and combine rows of both builds
# (eager median, host loop per iteration, graph replay; with --std-moe in EP_AB_BENCH also the
# standard-MoE rows) comes last. Every step is bounded; the
# whole section by EP_AB_BUDGET seconds.
# shellcheck source=tools/gpu/lib/budget_steps.sh
source "$(dirname "$0")/lib/budget_steps.sh"
section_start ep_build_ab "${EP_AB_BUDGET:-540}"
REF=${EP_REF_DIR:-.ref_engine}
ROUNDS=${EP_AB_ROUNDS:-1}
WORLDS=${EP_AB_WORLDS:-4 2}
REFSITE=/tmp/mori_ep_ref_site
[ -d "$REF" ] || { echo "ep_build_ab: no reference tree at $REF"; exit 1; }
rm -rf "$REFSITE" /tmp/ep_ab_ref.rc
( timeout --signal=KILL 300 env CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 )) MORI_CUDA_ARCH="${MORI_CUDA_ARCH:-90}" \
    $PY -m pip install -q --no-build-isolation --no-deps --no-compile --target "$REFSITE" "$REF" \
    > "$OUT/ep_ab_ref_build.log" 2>&1
  echo $? > /tmp/ep_ab_ref.rc ) &
BUILD=$!

run ep_ab_tests "${EP_AB_TESTS_S:-240}" \
  "$PY -m pytest -q -rs -p no:cacheprovider -o addopts='' ${EP_AB_TESTS:-tests/ep/test_gpu_ep.py tests/ep/test_gpu_ep_extensions.py -k \"(suite and 4) or timeout or mixed or (standard_moe_and_fp8_combine and 4)\"}"

wait "$BUILD"
ref_rc=$(cat /tmp/ep_ab_ref.rc 2>/dev/null || echo 1)
printf 'reference build (%s) rc=%s\n' "$REF" "$ref_rc" | tee -a "$SUMMARY"
builds=(new)
[ "$ref_rc" = 0 ] && builds=(ref new)

BENCH="MORI_SHMEM_HEAP_SIZE=${EP_AB_HEAP:-8G} $PY -m mori_core.bench ep ${EP_AB_BENCH:---tokens 128,512,4096 --dtypes bf16,fp8 --auto --iters 10 --eager-calls 30 --no-nccl}"
for i in $(seq 1 "$ROUNDS"); do
  for world in $WORLDS; do
    gpus=""; [ "$world" = 2 ] && gpus="CUDA_VISIBLE_DEVICES=0,1"
    for b in "${builds[@]}"; do
      path=""; [ "$b" = ref ] && path="$REFSITE:"
      run "ab_ep${world}_${b}_$i" "${EP_AB_STEP_S:-120}" \
        "$gpus PYTHONPATH=$path\${PYTHONPATH:-} $BENCH --world-size $world --json $OUT/ab_ep${world}_${b}_$i.json"
    done
  done
done

echo; echo "===== ep_build_ab ($(nvidia-smi -L 2>/dev/null | wc -l) GPU(s), $((SECONDS - T0)) s of $BUDGET s)"
cat "$SUMMARY"
grep -E "passed|failed|Error|error" "$OUT/ep_ab_tests.log" | tail -5
$PY - "$OUT" <<'EOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
cells = {}  # (world, tokens, call) -> build -> [(eager, loop, graph)]
for path in sorted(glob.glob(os.path.join(out, "ab_ep*_*_*.json"))):
    world, build, _ = os.path.basename(path)[len("ab_ep"):-len(".json")].split("_")
    for r in json.load(open(path))["rows"]:
        if r.get("ext") not in (None, "std") or not r["kernel"].startswith(("dispatch", "combine")):
            continue
        call = f"{r['kernel']} {r['dtype']} {r.get('mode', '')}".strip()
        cells.setdefault((int(world), r["tokens"], call), {}).setdefault(build, []).append(
            (r.get("eager_us"), r.get("loop_us"), r.get("graph_us")))


def med(v, i):
    xs = [x[i] for x in v if x[i] is not None]
    return statistics.median(xs) if xs else float("nan")


print("\n### EP kernels, reference build vs this build: eager median / host loop / graph (kernel alone), us")
print("| EP | tokens | call | ref eager | ref loop | ref graph | new eager | new loop | new graph | graph new/ref |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (world, tokens, call), by in sorted(cells.items()):
    ref, new = by.get("ref", []), by.get("new", [])
    ratio = med(new, 2) / med(ref, 2) if ref and new else float("nan")
    print(f"| {world} | {tokens} | {call} | {med(ref, 0):.1f} | {med(ref, 1):.1f} | {med(ref, 2):.1f} | "
          f"{med(new, 0):.1f} | {med(new, 1):.1f} | {med(new, 2):.1f} | {ratio:.3f} |")
EOF
