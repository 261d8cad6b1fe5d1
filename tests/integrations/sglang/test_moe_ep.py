"""``--moe-a2a-backend mori``: stock sglang 0.5.23's MORI dispatcher on mori-suite, CPU, EP2 over gloo.

Two processes per path (EPv2, SGLang's default, and EPv1) run SGLang's own dispatcher
(``create_moe_dispatcher`` -> ``MoriEPDispatcher``, see moe_ep_rank.py): dispatch -> per-expert
linear -> combine must equal a dense single-process MoE computed independently, for bf16, for
FP8 dispatch with per-128 scales (quantised by mori-suite's aiter replacement), and for an FP8
combine wire.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

WORLD = 2
SEED = 5
# Combine rounds expert outputs to bf16 before the sum (and FP8 combine to e4m3 per block);
# bounds relative to the largest output value.
TOL = {"bf16": 0.015, "fp8": 0.015, "fp8_combine": 0.06}
# EPv2 runs normal mode only (SGLang maps --deepep-mode auto to normal); EPv1 normal mode is the
# IntraNode kernel type, low_latency the AsyncLL split (dispatch_send/recv, combine_send/recv).
PATH_CASES = {
    "v2": ["bf16", "fp8", "fp8_combine"],
    "v1": ["bf16_normal", "fp8_normal", "fp8_combine_normal", "bf16_low_latency"],
}


RESULT_TIMEOUT_S = 240  # per rank result; both paths take ~15 s each on a 2-core machine


def _run_path(path: str) -> dict:
    from moe_ep_rank import STACKS_AFTER_S, rank_main

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # The ranks meet through a file, not a TCP port picked here and bound seconds later by the
    # spawned rank 0 (another process may take that port in between).
    rendezvous = tempfile.TemporaryDirectory(prefix="mori_moe_ep_")
    init_method = f"file://{rendezvous.name}/store"
    procs = [
        ctx.Process(target=rank_main, args=(r, WORLD, init_method, path, PATH_CASES[path], SEED, q), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    got, errors = {}, []
    try:
        for _ in range(WORLD):
            try:
                rank, out, err = q.get(timeout=RESULT_TIMEOUT_S)
            except queue.Empty:
                # Name the silent ranks and keep what the others reported (a rank that failed early
                # leaves its peer waiting); a hung rank printed its stacks to stderr (STACKS_AFTER_S).
                missing = sorted(set(range(WORLD)) - set(got))
                codes = {r: p.exitcode for r, p in enumerate(procs)}
                raise AssertionError(
                    f"{path}: no result from rank(s) {missing} within {RESULT_TIMEOUT_S} s (exit codes {codes}; "
                    f"a rank still running printed its stacks to stderr after {STACKS_AFTER_S} s)"
                    + "".join(f"\n{e}" for e in errors)) from None
            got[rank] = out
            if err:
                errors.append(f"rank {rank}:\n{err}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        rendezvous.cleanup()
    assert not errors, "\n".join(errors)
    return got


@pytest.fixture(scope="module", params=["v2", "v1"])
def path_results(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param, _run_path(request.param)


@pytest.mark.timeout(300)
def test_stock_dispatcher_equals_dense_moe(path_results: tuple[str, dict]) -> None:
    path, got = path_results
    for rank, cases in got.items():
        assert set(cases) == set(PATH_CASES[path]), cases
        for name, r in cases.items():
            where = f"{path} rank {rank} case {name}: {r}"
            assert r["received"] > 0, where
            assert r["out_shape"] == [24, 256] and r["out_dtype"] == "torch.bfloat16", where
            kind = name.replace("_normal", "").replace("_low_latency", "")
            assert r["max_err"] <= TOL[kind] * r["ref_max"], where


@pytest.mark.timeout(300)
def test_dtypes_and_engine_as_configured(path_results: tuple[str, dict]) -> None:
    """The cases ran what they claim: SGLang resolved the dtypes and built the expected op."""
    path, got = path_results
    suffix = "" if path == "v2" else "_normal"
    for rank, cases in got.items():
        bf16, fp8, fp8c = cases["bf16" + suffix], cases["fp8" + suffix], cases["fp8_combine" + suffix]
        assert bf16["dispatch_dtype"] == "bf16" and bf16["combine_dtype"] == "bf16", bf16
        assert fp8["dispatch_dtype"] == "fp8" and fp8["scales_shape"][1] == 256 // 128, fp8
        assert fp8c["combine_dtype"] == "fp8", fp8c
        if path == "v2":
            assert bf16["op"] == "mori_core.ops.dispatch_combine_v2.op.EpDispatchCombineOp", bf16
            assert bf16["backend"] == "mori_core.reference", bf16
        else:
            assert bf16["op"] == "mori_core.ops.reference.ReferenceEpDispatchCombineOp", bf16
            assert bf16["kernel_type"] == "IntraNode" and bf16["output"] == "MoriEPNormalDispatchOutput", bf16
            ll = cases["bf16_low_latency"]
            assert ll["kernel_type"] == "AsyncLL" and ll["output"] == "MoriEPLLDispatchOutput", ll
