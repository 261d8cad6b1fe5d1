#!/usr/bin/env bash
# Inter-node MORI-EP kernel types on the 2-GPU machine (after the suite is built and installed).
#
#   bash tools/gpu/ep_internode.sh [stage ...]   stages: probe p2p test1 test2 timeout bringup nettest1 bench
#                                                (default: probe p2p test1 test2 timeout bringup nettest1)
# p2p:      bring-up self test on NVSHMEM's default transports (NVLink P2P between the two GPUs);
#           test1/test2/timeout then run the kernels in that mode (the device code is the same:
#           nvshmem put-with-signal, only the transport under it differs).
# bringup:  tries NVSHMEM forced onto its network transport (P2P off); nettest1 reruns test1 in
#           the first network mode whose self test passed.
# gpu_per_node=1 makes each GPU its own "node". The bring-up tries NVSHMEM forced onto its
# network transport (P2P off, UCX over TCP) first. The first configuration whose
# put-with-signal self test passes is used for test1/timeout/bench. When none does (for
# example no GDRCopy: NVSHMEM's UCX transport needs it for the signals and barriers), the
# kernels run on NVSHMEM's default transports, and the summary says so.
# Logs (NVSHMEM_DEBUG=INFO for the bring-up) go to $OUT; a summary table is printed last.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
STAGES=${*:-probe p2p test1 test2 timeout bringup nettest1}
SUMMARY="$OUT/internode_summary.txt"
: > "$SUMMARY"
PYTEST="$PY -m pytest -q -x -p no:cacheprovider -o addopts= -s"
T=tests/ep/test_gpu_internode.py

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" >> "$OUT/$name.log"
  timeout --signal=KILL "$limit" bash -c "$*" >> "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
  return $rc
}

NVSH_LIB=$($PY -c "import importlib.util as u; print(list(u.find_spec('nvidia.nvshmem').submodule_search_locations)[0] + '/lib')" 2>/dev/null)
UCX_WHEEL_LIB=$($PY -c "import importlib.util as u, os; s = u.find_spec('libucx'); print(os.path.join(list(s.submodule_search_locations)[0], 'lib') if s else '')" 2>/dev/null)
NET_A="NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx UCX_TLS=tcp,cuda_copy"
NET_B="$NET_A UCX_NET_DEVICES=lo"
NET_C=""
[ -n "$UCX_WHEEL_LIB" ] && NET_C="$NET_A LD_LIBRARY_PATH=$UCX_WHEEL_LIB:\${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$UCX_WHEEL_LIB/ucx"
# Without GDRCopy (no /dev/gdrdrv), tell NVSHMEM not to look for it.
NET_D="$NET_A NVSHMEM_DISABLE_GDRCOPY=1"
MODE_ENV=""; MODE="p2p"; NET_MODE=""; NET_ENV=""

for s in $STAGES; do
  case $s in
    probe)
      { echo "nvshmem lib: $NVSH_LIB"; ls -l /dev/gdrdrv 2>&1; grep -i gdrdrv /proc/modules 2>&1; ldconfig -p | grep -i -E "gdrapi|libucp|libibverbs" ;
        command -v ucx_info && ucx_info -v && ucx_info -d | grep -E "Memory domain|Transport|Device" | head -40;
        echo "libucx wheel lib: ${UCX_WHEEL_LIB:-none}"; ls "$NVSH_LIB"; ldd "$NVSH_LIB"/nvshmem_transport_ucx.so.*;
        [ -n "$UCX_WHEEL_LIB" ] && LD_LIBRARY_PATH=$UCX_WHEEL_LIB "$UCX_WHEEL_LIB/../bin/ucx_info" -d | grep -E "Memory domain|Transport" | head -30;
        command -v ibv_devices && ibv_devices; ip -brief addr; nvidia-smi topo -m;
        $PY -c "import mori_core; print(mori_core.build_info())"; } > "$OUT/probe.log" 2>&1
      grep -E "internode|gdrdrv|No such|ucx_info|Transport: (tcp|cuda)" "$OUT/probe.log" | head -12 >> "$SUMMARY" ;;
    p2p)
      stage bringup_p2p 60 "env NVSHMEM_DEBUG=INFO MORI_TEST_NET_MODE=p2p $PYTEST $T::test_nvshmem_bringup"
      grep -h "BRINGUP" "$OUT/bringup_p2p.log" | head -2 >> "$SUMMARY" ;;
    bringup)
      for cfg in D A C; do
        eval envs=\"\$NET_$cfg\"
        [ -z "$envs" ] && continue
        # SIGINT first so a hung NVSHMEM call leaves its last log lines; KILL 5 s later.
        t0=$SECONDS
        echo "=== bringup_net_$cfg: $envs" > "$OUT/bringup_net_$cfg.log"
        timeout --signal=INT --kill-after=5 40 bash -c "env $envs NVSHMEM_DEBUG=INFO UCX_LOG_LEVEL=info MORI_TEST_NET_MODE='net-$cfg' $PYTEST $T::test_nvshmem_bringup" >> "$OUT/bringup_net_$cfg.log" 2>&1
        rc=$?
        printf '%-22s rc=%-3s %4ss\n' "bringup_net_$cfg" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
        if [ $rc = 0 ]; then NET_ENV="$envs"; NET_MODE="net-$cfg"; break; fi
        echo "  last lines of bringup_net_$cfg.log:" >> "$SUMMARY"
        grep -v "^\s*$" "$OUT/bringup_net_$cfg.log" | tail -12 | cut -c1-220 | sed 's/^/    /' >> "$SUMMARY"
      done
      echo "network mode: ${NET_MODE:-none passed}" | tee -a "$SUMMARY" ;;
    nettest1)
      if [ -n "$NET_MODE" ]; then
        stage test_gpn1_net 150 "env $NET_ENV MORI_TEST_NET_MODE=$NET_MODE $PYTEST '$T::test_internode_kernel_types[1]'"
        grep -h "INTERNODE rank=0\|Error\|assert" "$OUT/test_gpn1_net.log" | head -16 >> "$SUMMARY"
      else
        echo "nettest1: skipped (no network mode passed its bring-up)" | tee -a "$SUMMARY"
      fi ;;
    test1)
      stage test_gpn1 120 "env $MODE_ENV MORI_TEST_NET_MODE=$MODE $PYTEST '$T::test_internode_kernel_types[1]'"
      grep -h "INTERNODE rank=0\|Error\|assert" "$OUT/test_gpn1.log" | head -16 >> "$SUMMARY" ;;
    test2)
      stage test_gpn2 120 "$PYTEST '$T::test_internode_kernel_types[2]'"
      grep -h "INTERNODE rank=0\|Error\|assert" "$OUT/test_gpn2.log" | head -12 >> "$SUMMARY" ;;
    timeout)
      stage timeout 90 "env $MODE_ENV MORI_TEST_NET_MODE=$MODE $PYTEST $T::test_timeout_names_the_missing_peer"
      grep -h "TIMEOUT" "$OUT/timeout.log" | head -2 >> "$SUMMARY" ;;
    bench)
      stage bench_gpn1 100 "env $MODE_ENV $PY -m mori_core.bench ep --world-size 2 --kernel-type InterNodeV1,InterNodeV1LL,AsyncLL,InterNode --gpu-per-node 1 --tokens 128,1024 --dtypes bf16 --iters 5 --json $OUT/bench_internode_gpn1.json"
      stage bench_gpn2 80 "$PY -m mori_core.bench ep --world-size 2 --kernel-type InterNodeV1,AsyncLL,IntraNode --gpu-per-node 2 --tokens 128,4096 --dtypes bf16,fp8 --iters 10 --json $OUT/bench_internode_gpn2.json" ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done

echo; echo "===== inter-node summary (mode: $MODE)"; cat "$SUMMARY"
for f in bench_gpn1 bench_gpn2; do
  [ -f "$OUT/$f.log" ] && { echo "----- $f"; grep -E "^\||^###|Error" "$OUT/$f.log" | head -40; }
done
exit 0
