#!/usr/bin/env bash
# What the NVLink fabric gives SM kernels, and where a small dispatch's time goes per rank
# (issue #31, round 8).
#
#   bash tools/gpu_check.sh link_profile        (or: bash tools/gpu/link_profile.sh, suite installed)
#
# Stages (LINK_STAGES, default all, in this order; each bounded, the section by LINK_BUDGET s):
#   profbuild  a profiler build (MORI_ENABLE_PROFILER=ON) into /tmp/prof_site, in the background
#              while ccltest runs; the timed stages wait for it
#   ccltest    tests/ccl/test_gpu_ccl.py on 4 GPUs (every collective, and the SM link probe's
#              bytes in every mode)
#   link       python -m mori_core.bench ccl --ceilings at 4 GPUs: copy engines and the SM probe
#              kernels (16-byte pushes as the dispatch makes them, TMA bulk pushes, 16-byte pulls
#              as the pull combine), all peers at once and pairwise, beside NCCL's all-to-all
#   phases     tools/gpu/ep_phases.py on the profiler build: per rank and phase, EP4 x 128 / 512
#              FP8 dispatch, EP4 x 128 BF16 dispatch + combine, EP2 x 128 FP8 dispatch (LINK_PHASE_RUNS:
#              other runs, "name:arguments;..." e.g. "std4:--world 4 --std --blocks 128")
# shellcheck source=tools/gpu/lib/budget_steps.sh
source "$(dirname "$0")/lib/budget_steps.sh"
section_start link_profile "${LINK_BUDGET:-330}"
STAGES=" ${LINK_STAGES:-profbuild ccltest link phases} "
PROF_SITE=/tmp/prof_site
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
W=$(( ngpu >= 4 ? 4 : ngpu ))

PROF_PID=""
if [[ $STAGES == *" profbuild "* ]] && [ ! -f "$PROF_SITE/.ok" ]; then
  ( t=$SECONDS
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) MORI_CUDA_ARCH=${MORI_CUDA_ARCH:-90} $PY -m pip install -q --no-build-isolation \
      --no-deps --target "$PROF_SITE" -Cbuild-dir=/tmp/prof_build -Ccmake.define.MORI_ENABLE_PROFILER=ON . \
      > "$OUT/profbuild.log" 2>&1 && touch "$PROF_SITE/.ok"
    echo "profiler build rc=$? in $((SECONDS - t)) s" >> "$OUT/profbuild.log" ) &
  PROF_PID=$!
fi
if [[ $STAGES == *" ccltest "* ]]; then
  run ccltest 60 "CCL_TEST_TIMEOUT=55 MORI_TEST_STACKS_AFTER_S=50 $PY -m pytest -q -rfs -s -p no:cacheprovider -o addopts= tests/ccl/test_gpu_ccl.py -k 'suite and $W'"
  grep -hE "parts:|failure|differs|link probe" "$OUT/ccltest.log" | head -12
fi
if [ -n "$PROF_PID" ]; then  # nothing is timed while the compiler runs
  echo "waiting for the profiler build ($(date +%T))"; wait "$PROF_PID"; tail -2 "$OUT/profbuild.log" | tee -a "$SUMMARY"
fi
if [[ $STAGES == *" link "* ]]; then
  run link 90 "MORI_SHMEM_HEAP_SIZE=8G $PY -m mori_core.bench ccl --world-size $W --collectives all2all --sizes 64M,256M --engines sm --no-overlap --ceilings --json $OUT/link.json"
  awk '/^### /{p = ($0 ~ /ceilings|best of ours|latency/)} p' "$OUT/link.log" | grep -E "^###|^\|" | grep -v "^|--"
fi
if [[ $STAGES == *" phases "* ]] && [ -f "$PROF_SITE/.ok" ]; then
  PH="PYTHONPATH=$PROF_SITE\${PYTHONPATH:+:\$PYTHONPATH} $PY tools/gpu/ep_phases.py"
  # LINK_PHASE_RUNS: "name:ep_phases.py arguments" entries separated by ";" (each run bounded by 60 s)
  IFS=';' read -r -a phase_runs <<< "${LINK_PHASE_RUNS:-ep4_fp8:--world $W --dtype fp8 128 512;ep4_bf16:--world $W --dtype bf16 128;ep2_fp8:--world 2 --dtype fp8 128}"
  for entry in "${phase_runs[@]}"; do run "phases_${entry%%:*}" 60 "$PH ${entry#*:}"; done
  for entry in "${phase_runs[@]}"; do
    f="phases_${entry%%:*}"; echo "--- $f"; grep -E "^rank|^  (dispatch|combine)|^    |build|Error" "$OUT/$f.log" | head -60
  done
fi
echo; echo "===== link_profile ($ngpu GPU(s), $((SECONDS - T0)) s of $BUDGET s)"
cat "$SUMMARY"
! grep -qE "rc=[1-9]" "$SUMMARY"
