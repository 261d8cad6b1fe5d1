#!/usr/bin/env bash
# Diagnostic: symbolized backtraces of crashes seen on the GPU machine.
set -uo pipefail
cat > /tmp/target_steps.py <<'PY'
import socket, threading, torch, sys
from mori_core.io import *
backend = sys.argv[1]
e = IOEngine("t", IOEngineConfig(host="127.0.0.1", port=0, enable_auto_xgmi=backend == "xgmi"))
e.create_backend(BackendType.XGMI if backend == "xgmi" else BackendType.TCP)
print("engine ok", flush=True)
buf = torch.zeros(1 << 27, dtype=torch.uint8, device="cuda:1") if backend == "xgmi" else torch.zeros(1 << 27, dtype=torch.uint8).pin_memory()
print("alloc ok", flush=True)
md = e.register_torch_tensor(buf)
print("register ok", md, flush=True)
PY
for b in tcp xgmi; do
  echo "=== target steps ($b)"
  MORI_IO_LOG_LEVEL=debug timeout 60 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex "bt 15" \
    --args python3 /tmp/target_steps.py $b 2>&1 | grep -vE "^\[New|^\[Thread|Detaching|^$|warning: Cuda" | tail -25
done
echo "=== dead peer"
MORI_IO_LOG_LEVEL=debug timeout 120 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex "bt 15" \
  --args python3 -m pytest tests/io/test_gpu_io.py -q -x -p no:cacheprovider -k dead_peer 2>&1 \
  | grep -vE "^\[New|^\[Thread|Detaching|^$|warning: Cuda" | tail -40
