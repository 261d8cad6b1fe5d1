"""Runs the RDMA backend for real against the software verbs provider
(tests/rdma/fake_verbs), so the code that needs a NIC — device setup, QP
exchange over the control plane, posting, completion polling, notifications,
failure handling — is exercised in CI. Each run is a fresh interpreter with
MORI_IBVERBS_LIBRARY pointing at the fake library.

This validates our use of the verbs interface against a model of it; it is
not a substitute for a run on a real NIC (see docs/rdma.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from rdma_helpers import REPO, run_pytest


def _summary(out: str) -> dict[str, int]:
    counts = {}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", out):
        counts[word] = int(n)
    return counts


def test_e2e_matrix_against_the_fake_provider(fake_verbs_library: str) -> None:
    # Host memory only: the fake moves bytes with memcpy, which cannot reach GPU memory.
    res = run_pytest(["tests/rdma/test_rdma_e2e.py", "-m", "not gpu"], {"MORI_IBVERBS_LIBRARY": fake_verbs_library},
                     timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    counts = _summary(out)
    assert counts.get("passed", 0) >= 60, out[-3000:]
    assert "no usable RDMA device" not in out, "the fake provider was not picked up"


def test_failure_handling_against_the_fake_provider(fake_verbs_library: str) -> None:
    res = run_pytest(["tests/rdma/fake_fault_cases.py"], {"MORI_IBVERBS_LIBRARY": fake_verbs_library}, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert _summary(out).get("passed", 0) >= 13 and "failed" not in _summary(out), out[-3000:]


TWO_NICS = """
import numpy as np
from mori_core.io import BackendType, IOEngine, IOEngineConfig, MemoryLocationType, StatusCode
a, b = IOEngine("init", IOEngineConfig("127.0.0.1", 0)), IOEngine("tgt", IOEngineConfig("127.0.0.1", 0))
for e in (a, b):
    e.create_backend(BackendType.RDMA)
a.register_remote_engine(b.get_engine_desc())
bufs = [np.full(4096, i + 1, dtype=np.uint8) for i in range(4)]
mems = [e.register_memory(x.ctypes.data, 4096, -1, MemoryLocationType.CPU) for e, x in zip((a, a, b, b), bufs)]
for src, dst in ((0, 2), (1, 3)):
    s = a.write(mems[src], 0, mems[dst], 0, 4096, a.allocate_transfer_uid())
    assert s.WaitFor(10000) == StatusCode.SUCCESS, s.Message()
assert (bufs[2] == 1).all() and (bufs[3] == 2).all()
print("DONE")
"""


def _two_nic_run(fake: str, extra: dict[str, str]) -> str:
    env = dict(os.environ, MORI_IBVERBS_LIBRARY=fake, FAKE_VERBS_DEVICES="fake0,fake1", MORI_IO_LOG_LEVEL="info")
    env.update(extra)
    res = subprocess.run([sys.executable, "-c", TWO_NICS], capture_output=True, text=True, timeout=120, env=env,
                         cwd=str(REPO))
    assert res.returncode == 0 and "DONE" in res.stdout, res.stdout + res.stderr
    return res.stderr


def test_host_memory_is_spread_over_nics(fake_verbs_library: str) -> None:
    log = _two_nic_run(fake_verbs_library, {})
    assert re.search(r"connected 1 queue pair\(s\) fake0:1 -> engine 'tgt' \(\S+\) fake0:1", log), log
    assert re.search(r"connected 1 queue pair\(s\) fake1:1 -> engine 'tgt' \(\S+\) fake1:1", log), log


def test_device_filter_limits_the_nics(fake_verbs_library: str) -> None:
    log = _two_nic_run(fake_verbs_library, {"MORI_RDMA_DEVICES": "^fake0"})
    assert "using fake1:1" in log and "using fake0:1" not in log, log
    assert "fake0:1 ->" not in log
