#!/usr/bin/env bash
# Diagnostic: backtraces of every thread if the XGMI dead-peer test crashes.
set -uo pipefail
timeout 120 cuda-gdb -q -batch -ex "set pagination off" -ex "set print thread-events off" -ex run \
  -ex "info threads" -ex "thread apply all bt 12" \
  --args python3 -m pytest tests/io/test_gpu_io.py -q -x -p no:cacheprovider -k dead_peer 2>&1 | grep -vE "^\[New|^\[Thread|Detaching|^$" | tail -80
