#!/usr/bin/env bash
# Small batches (issue #31, round 7): which combine kernel should serve each call, and whether the
# eager figures are the kernel's or the host's.
#
#   bash tools/gpu_check.sh ep_small_ab          (or: bash tools/gpu/ep_small_ab.sh, suite installed)
#
# `bench ep` at SMALL_AB_TOKENS (128,512) tokens in SMALL_AB_DTYPES (bf16), EP4 on all GPUs and EP2
# on GPUs 0,1, once per value of the op setting SMALL_AB_VAR (MORI_EP_COMBINE_ALGO) in turn
# (SMALL_AB_ROUNDS rounds). The values (SMALL_AB_ALGOS) of the default setting:
#   auto   what callers get (push call: push kernel; pull call: the op's choice)
#   push   every call on the push kernel (a pull call reads the registered buffer)
#   pull   every call on the pull kernel (a push call copies into the registered buffer first)
# e.g. SMALL_AB_VAR=MORI_EP_DISPATCH_PER_DEST_WARPS SMALL_AB_ALGOS="-1 0" A/Bs the dispatch's copy items.
# Each row has the eager latency (event pair per call, DeepEP's method), the host's time per call
# and per loop iteration (when the loop is as long as the latency, the GPU waited for the host),
# and the kernel alone (CUDA-graph replay). A table of the combine rows per variant comes last.
# Every step is bounded; the whole section by SMALL_AB_BUDGET seconds.
# shellcheck source=tools/gpu/lib/budget_steps.sh
source "$(dirname "$0")/lib/budget_steps.sh"
section_start ep_small_ab "${SMALL_AB_BUDGET:-330}"
ROUNDS=${SMALL_AB_ROUNDS:-1}
ALGOS=${SMALL_AB_ALGOS:-auto push pull}
WORLDS=${SMALL_AB_WORLDS:-4 2}

VAR=${SMALL_AB_VAR:-MORI_EP_COMBINE_ALGO}
BENCH="MORI_SHMEM_HEAP_SIZE=${SMALL_AB_HEAP:-4G} $PY -m mori_core.bench ep --tokens ${SMALL_AB_TOKENS:-128,512} --dtypes ${SMALL_AB_DTYPES:-bf16} --auto --iters 20 --eager-calls 50 --no-nccl"
for i in $(seq 1 "$ROUNDS"); do
  for world in $WORLDS; do
    gpus=""; [ "$world" = 2 ] && gpus="CUDA_VISIBLE_DEVICES=0,1"
    for algo in $ALGOS; do
      run "ep${world}_${algo}_$i" "${SMALL_AB_STEP_S:-60}" "$gpus $VAR=$algo $BENCH --world-size $world --json $OUT/small_ep${world}_${algo}_$i.json"
    done
  done
done

echo; echo "===== ep_small_ab ($(nvidia-smi -L 2>/dev/null | wc -l) GPU(s), $((SECONDS - T0)) s of $BUDGET s)"
cat "$SUMMARY"
$PY - "$OUT" "$VAR" <<'EOF'
import glob, json, os, sys
out, var = sys.argv[1], sys.argv[2]
print("\n### Small batches: eager median / host loop per iteration / graph (kernel alone), us, mean over ranks")
print(f"| EP | tokens | call | {var} | run | eager | host us/call | host loop | graph |")
print("|---|---|---|---|---|---|---|---|---|")
rows = []
for path in sorted(glob.glob(os.path.join(out, "small_ep*_*_*.json"))):
    world, algo, run = os.path.basename(path)[len("small_ep"):-len(".json")].split("_")
    for r in json.load(open(path))["rows"]:
        if r.get("ext") or not (r["kernel"].startswith("combine") or r["kernel"].startswith("dispatch")):
            continue
        rows.append((int(world), r["tokens"], f"{r['kernel']} {r['dtype']} {r.get('mode', '')}", algo, run, r))
for world, tokens, call, algo, run, r in sorted(rows, key=lambda t: (-t[0], t[1], t[2], t[3], t[4])):
    g = r.get("graph_us")
    print(f"| {world} | {tokens} | {call} | {algo} | {run} | {r['eager_us']:.1f} | {r['host_us']:.1f} | "
          f"{r.get('loop_us', float('nan')):.1f} | {'-' if g is None else f'{g:.1f}'} |")
EOF
! grep -qE "rc=[1-9]" "$SUMMARY"
