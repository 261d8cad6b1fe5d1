"""mori_ep inside vLLM's modular kernel equals a single-process MoE (2 CPU ranks, gloo).

Two fresh interpreters run ``vllm_ep_worker.py``: each loads vLLM's plugins, brings up vLLM's
DP x EP distributed state with ``all2all_backend="mori_ep"`` and runs every case of
``vllm_ep_worker.CASES`` through ``FusedMoEKernel(MoriPrepareAndFinalize, reference experts)``
over the core's reference EP operator. Cases cover random routing, ragged token counts (0
included), FP8 off/on (transport flag, per-token, 1x128 block, static and dynamic per-tensor,
quantisation deferred to the experts), finalize-side weight-and-reduce and top-1 weight on
input, and batched experts (MORI's standard-MoE layout; chosen by --moe-backend batched_triton or
VLLM_MORI_EP_BATCHED_EXPERTS=1).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vllm_ep_worker import CASES  # noqa: E402

WORLD_SIZE = 2
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Run both ranks once (bounded) and return their JSON results."""
    tmp = tmp_path_factory.mktemp("mori_ep_numerics")
    port = _free_port()
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1")
    procs = []
    for rank in range(WORLD_SIZE):
        out = tmp / f"rank{rank}.json"
        log = open(tmp / f"rank{rank}.log", "w")
        cmd = [
            sys.executable,
            str(HERE / "vllm_ep_worker.py"),
            "--rank",
            str(rank),
            "--world-size",
            str(WORLD_SIZE),
            "--port",
            str(port),
            "--out",
            str(out),
        ]
        procs.append((subprocess.Popen(cmd, cwd=str(HERE), env=env, stdout=log, stderr=subprocess.STDOUT), out, log))
    results = []
    try:
        for proc, out, log in procs:
            try:
                proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank worker hung for {TIMEOUT_S}s; log: {log.name}")
            log.close()
            tail = Path(log.name).read_text()[-4000:]
            assert out.exists(), f"rank worker wrote no result (exit {proc.returncode}):\n{tail}"
            results.append(json.loads(out.read_text()))
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for rank, res in enumerate(results):
        assert res["setup"] is None, f"rank {rank} failed to set up:\n{res['setup']}"
    return results


def test_ep_group_uses_mori_ep_manager(rank_results: list[dict]) -> None:
    """vLLM's EP communicator built our manager (plugin hook), and destroy() released it."""
    for res in rank_results:
        assert res["manager"] == "mori_integrations.vllm.all2all.MoriEpAll2AllManager"
        assert res["manager_destroyed"] is True


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_matches_single_process_moe(rank_results: list[dict], case: str) -> None:
    """Each rank's MoE output equals the single-process MoE of its tokens."""
    for rank, res in enumerate(rank_results):
        assert case in res["cases"], f"rank {rank} did not run {case}"
        assert res["cases"][case] is None, f"rank {rank}, case {case}:\n{res['cases'][case]}"
