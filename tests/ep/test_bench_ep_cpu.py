"""CPU tests of what issue #31 added around the IntraNode kernels: the combine-kernel choice, the
benchmark's DeepEP baseline helpers (without DeepEP or a GPU) and the PNG plot module."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from mori_core.bench import plot
from mori_core.bench.ep import deepep_normal
from mori_core.ops.launch_config import (
    COMBINE_ALGO_ENV,
    COMBINE_MODES,
    LaunchParams,
    combine_algorithm_override,
    combine_mode,
    combine_table_kernel,
)

PUSH, PULL, COPY_PULL = COMBINE_MODES["push"], COMBINE_MODES["pull"], COMBINE_MODES["copy_pull"]
PULL_OR_PUSH = COMBINE_MODES["pull_or_push"]


def test_combine_mode_auto_forced_and_table() -> None:
    # auto: FP8 always pushes (the pull kernel quantises, then reads: two passes); BF16 follows the
    # call, a pull call's small rounds pushing (decided on the device)
    assert combine_mode(True, 0) == PUSH and combine_mode(False, 0) == PULL_OR_PUSH
    for quant in (1, 2):
        assert combine_mode(True, quant) == PUSH and combine_mode(False, quant) == PUSH
    # forced: a push call on the pull kernel copies its rows into the registered buffer first
    assert combine_mode(True, 0, "pull") == COPY_PULL and combine_mode(False, 2, "pull") == PULL
    assert combine_mode(False, 0, "push") == PUSH
    assert combine_table_kernel(PUSH) == "combine_push"
    assert combine_table_kernel(PULL) == combine_table_kernel(COPY_PULL) == "combine_pull"
    assert combine_table_kernel(PULL_OR_PUSH) == "combine_pull"  # the pull call's grid, either algorithm
    assert LaunchParams(80, 8) == LaunchParams(80, 8, -1)  # mode defaults to "not a combine"


def test_combine_algorithm_override_reads_and_checks_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COMBINE_ALGO_ENV, raising=False)
    assert combine_algorithm_override() == "auto"
    monkeypatch.setenv(COMBINE_ALGO_ENV, " PULL ")
    assert combine_algorithm_override() == "pull"
    monkeypatch.setenv(COMBINE_ALGO_ENV, "scatter")
    with pytest.raises(ValueError, match=f"{COMBINE_ALGO_ENV}='scatter' must be auto, push or pull"):
        combine_algorithm_override()


def test_deepep_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError
    ok, why = deepep_normal.available()
    assert not ok and "deep_ep is not importable" in why


def test_deepep_row_keys_follow_its_layout() -> None:
    """DeepEP receives rows grouped by source rank (rank_prefix_matrix[s][rank] = rows from sources
    <= s) with their source token (recv_src_idx); keys = source rank * stride + token."""
    rank, stride = 1, 100
    prefix = torch.tensor([[0, 2, 0], [0, 2, 0], [0, 5, 0]], dtype=torch.int32)  # rank 1: 2 rows from 0, 3 from 2
    src_idx = torch.tensor([4, 9, 0, 3, 7], dtype=torch.int32)
    handle = (prefix, None, None, src_idx, None, None)
    keys = deepep_normal._deepep_keys(handle, rank, stride)
    assert keys.tolist() == [4, 9, 200, 203, 207]
    rows = torch.arange(5)
    assert deepep_normal._sorted_rows(torch.tensor([3, 1, 2, 0, 4]), rows).tolist() == [3, 1, 2, 0, 4]


def test_deepep_comparison_pairs_each_call_with_the_best_setting() -> None:
    def row(lib: str, kernel: str, sms: int, us: float, tokens: int = 128) -> dict:
        return dict(lib=lib, kernel=kernel, sms=sms, mean_us=us, tokens=tokens, chunk=8)

    rows = [row("ours", "dispatch bf16", 0, 20.0), row("ours", "combine push", 0, 30.0),
            row("ours", "dispatch bf16", 24, 25.0),  # SM for SM: not a "best vs best" row
            row("deepep", "dispatch bf16", 24, 50.0), row("deepep", "dispatch bf16", 48, 40.0),
            row("deepep", "dispatch bf16 (with top-k)", 48, 45.0), row("deepep", "combine", 24, 60.0)]
    best = {(b["kernel"]): b for b in deepep_normal.ours_vs_best(rows)}
    assert set(best) == {"dispatch bf16", "combine push"}
    assert best["dispatch bf16"]["deepep"]["sms"] == 48 and best["dispatch bf16"]["ratio"] == pytest.approx(2.0)
    assert best["dispatch bf16"]["deepep_topk"]["mean_us"] == 45.0
    assert best["combine push"]["ratio"] == pytest.approx(2.0) and best["combine push"]["deepep_topk"] is None


def test_bench_ep_options_parse() -> None:
    from mori_core.bench import ep

    p = argparse.ArgumentParser()
    ep.add_arguments(p)
    args = p.parse_args(["--deepep", "--deepep-sms", "24,132", "--tune", "--tune-tokens", "4096", "--plot", "x.png"])
    assert args.deepep and args.deepep_sms == "24,132" and args.tune and args.plot == "x.png"
    assert p.parse_args([]).deepep_dispatch_chunks == deepep_normal.DEFAULT_DISPATCH_CHUNKS
    assert p.parse_args(["--tune", "--tune-push"]).tune_push and not p.parse_args(["--tune"]).tune_push


def test_plot_panels_drop_missing_points_and_need_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    panel = plot.Panel("dispatch", "tokens", "us")
    panel.add("ours", [(512, 30.0), (128, 20.0), (4096, None), (1024, float("nan"))])
    panel.add("nothing", [(128, None)])
    assert [(s.label, s.xs, s.ys) for s in panel.series] == [("ours", [128.0, 512.0], [20.0, 30.0])]
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.write_png(str(tmp_path / "a.png"), "t", [plot.Panel("empty", "x", "y")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plot.PlotUnavailable, match="pip install matplotlib"):
        plot.write_png(str(tmp_path / "a.png"), "t", [panel])


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    panel = plot.Panel("combine", "tokens", "us", ylog=True)
    panel.add("ours", [(128, 20.0), (4096, 400.0)])
    panel.add("DeepEP", [(128, 40.0), (4096, 500.0)], baseline=True)
    path = plot.write_png(str(tmp_path / "ep.png"), "EP4", [panel, plot.Panel("empty", "x", "y")])
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _timing(us: float) -> dict:
    return dict(eager_us=us, eager_mean_us=us, host_us=5.0, loop_us=us + 1.0, us=us, graph_us=None)


def _rank_rows(rank: int) -> list[dict]:
    """Rows shaped as one rank of `bench ep --fp8-combine --std-moe --deepep --tune` puts them."""
    n, h = 128, 7168
    base = dict(tokens=n, recv=400, bytes=400 * h * 2, blocks=32, warps=4)
    rows = [dict(base, kernel="dispatch", dtype=d, mode="-", **_timing(20.0)) for d in ("fp8", "bf16")]
    rows += [dict(base, kernel="combine", dtype="bf16", mode=f"{c} call, push kernel", **_timing(25.0))
             for c in ("default", "push", "pull")]
    rows += [dict(table="breakdown", part="op.dispatch (full Python call)", tokens=n, host_us=3.0, loop_call_us=3.5,
                  loop_us=20.0 + rank)]
    for kernel, us in (("combine bf16", 25.0), ("combine fp8_direct_cast", 15.0), ("combine fp8_blockwise", 16.0)):
        for mode in ("push", "pull"):
            rows.append(dict(base, kernel=kernel, dtype="bf16", mode=mode, ext="fp8", link_bytes=1e6, crossing=300,
                             speedup=1.0, rel_err=0.02, max_err=0.1, **_timing(us)))
    # the 2-D dispatch's eager call host-bound (20 us eager, a 14 us kernel): by the graph replays the
    # standard-MoE dispatch takes 2x, though its eager ratio is 1.2x
    rows += [dict(base, kernel=k, dtype="bf16", mode="std", ext="std", **dict(_timing(us), graph_us=g))
             for k, us, g in (("dispatch (same op)", 20.0, 14.0), ("dispatch_standard_moe", 24.0, 28.0),
                              ("dispatch_standard_moe [MORI_EP_STD_FUSED=0]", 40.0, None),
                              ("dispatch_standard_moe + combine_standard_moe [MORI_EP_STD_FUSED=0]", 60.0, None))]
    t = dict(table="deepep", tokens=n, median_us=1.0, min_us=1.0, host_us=20.0)
    for kernel, us in (("dispatch fp8", 20.0), ("dispatch bf16", 20.0), ("combine (default call)", 25.0),
                       ("combine push", 25.0), ("combine pull", 26.0)):
        rows.append(dict(t, lib="ours", kernel=kernel, sms=0, mean_us=us))
    for kernel in ("dispatch bf16", "dispatch fp8", "combine"):
        for sms in (24, 132):
            rows.append(dict(t, lib="deepep", kernel=kernel, sms=sms, chunk=8, mean_us=40.0 + rank))
            rows.append(dict(t, lib="ours", kernel="combine (default call)" if kernel == "combine" else kernel,
                             sms=sms, mean_us=30.0))
    rows += [dict(table="deepep_kernels", tokens=n, call=c, ours_us=10.0 + rank, ours_kernels="ours x1",
                  deepep_us=30.0, deepep_kernels="notify x1; combine x1", sms=24, chunk=8)
             for c in ("combine (default call)", "combine push")]
    rows += [dict(t, lib="deepep", kernel="dispatch bf16 (with top-k)", sms=24, chunk=8, mean_us=50.0),
             dict(table="deepep_check", tokens=n, what="combine output (bf16)", equal=True, max_abs_diff=0.0),
             dict(table="tune", tokens=n, kernel="combine bf16", call="push", algo="push", blocks=32, warps=4,
                  mean_us=24.0, median_us=24.0, min_us=23.0, host_us=5.0),
             dict(table="tune", tokens=n, kernel="combine bf16 (overlap)", call="push", algo="push", blocks=132,
                  warps=16, overlap="1", reduce_blocks=-1, mean_us=22.0, median_us=22.0, min_us=21.0, host_us=5.0)]
    rows += [dict(base, kernel="nccl a2a (dispatch)", dtype="bf16", mode="-", **_timing(30.0))]
    return rows


def test_ep_report_tables_targets_and_plot(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                           tmp_path) -> None:
    from mori_core.bench import ep
    from mori_core.bench.ep import intranode
    from mori_core.placement import placement

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "FakeGPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    p = argparse.ArgumentParser()
    ep.add_arguments(p)
    png = tmp_path / "ep.png"
    args = p.parse_args(["--plot", str(png), "--json", str(tmp_path / "ep.json")])
    assert intranode.report({0: _rank_rows(0), 1: _rank_rows(1)}, args, 2, placement(2)) == 0
    out = capsys.readouterr()
    assert "ours vs DeepEP at its best" in out.out and "SM for SM" in out.out and "launch sweep" in out.out
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in out.out.splitlines() if line.startswith("|")]
    # 128 tokens: DeepEP's best is 40.5 us (mean over ranks) against our 20 us (dispatch) and 26 us (pull)
    assert ["128", "dispatch bf16 vs DeepEP best", "2.02x", ">= 1.6x", "yes"] in cells
    assert ["128", "combine pull vs DeepEP best", "1.56x", ">= 1.6x", "no"] in cells
    assert ["128", "dispatch_standard_moe / 2-D dispatch", "1.20x eager, 2.00x graph", "<= 1.3x", "no"] in cells
    assert ["128", "dispatch_standard_moe [MORI_EP_STD_FUSED=0] / 2-D dispatch", "2.00x eager", "<= 1.3x", "no"] in cells
    assert ["128", "combine output (bf16)", "yes", "0"] in cells
    # kernels alone: ours 10.5 us (mean over ranks) against DeepEP's 30
    assert ["128", "combine push", "10.5", "30.0", "2.86x", "24", "8", "ours x1", "notify x1; combine x1"] in cells
    # the call inside the eager loop and the iteration around it (mean over ranks: 20.5 - 3.5)
    assert ["op.dispatch (full Python call)", "3.00", "3.50", "20.5", "17.0"] in cells
    # the host loop column (eager 20 us, loop 21 us: host-bound)
    assert any(c[:2] == ["dispatch", "-"] and "21.0" in c for c in cells)
    assert ["combine bf16 (overlap)", "push", "push", "128", "132x16", "-", "1", "-1", "22.0", "5.00"] in cells
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "--plot needs matplotlib" in out.err
    else:
        assert png.read_bytes()[:4] == b"\x89PNG"


def _one_rank_fails_one_hangs(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    """A spawned rank: rank 0 reports a failure, rank 1 waits as if in a collective with it."""
    import time

    if rank == 0:
        results.put((0, [], "Traceback: an illegal memory access was encountered"))
    else:
        time.sleep(120)


def test_spawn_ranks_reports_a_failed_rank_and_stops_the_waiting_ones(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Round 1's EP2 bench: one rank crashed, the other waited in a collective until the section's
    # timeout killed the run, and the traceback was never printed.
    import time

    from mori_core.bench.ep import measure

    monkeypatch.setattr(measure, "ERROR_GRACE_S", 1.0)
    t0 = time.monotonic()
    assert measure.spawn_ranks(_one_rank_fails_one_hangs, 2, argparse.Namespace()) is None
    assert time.monotonic() - t0 < 60
    out = capsys.readouterr().out
    assert "rank 0:\nTraceback: an illegal memory access was encountered" in out
    assert "ranks [1]: no report 1.0 s after another rank failed" in out


def _agree_rank(rank: int, world: int, port: int, out: "torch.multiprocessing.Queue") -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # Each rank's own fastest setting differs (rank 0: 24 SMs / chunk 4, rank 1: 48 SMs / chunk 8);
        # averaged over both ranks, 48 SMs with chunk 6 wins for dispatch, chunk 2 for combine.
        mine = {
            0: {("dispatch bf16", 24, 4): 10.0, ("dispatch bf16", 24, 8): 30.0, ("dispatch bf16", 48, 6): 12.0,
                ("dispatch bf16", 48, 8): 25.0, ("combine", 24, 1): 9.0, ("combine", 24, 2): 11.0},
            1: {("dispatch bf16", 24, 4): 30.0, ("dispatch bf16", 24, 8): 20.0, ("dispatch bf16", 48, 6): 14.0,
                ("dispatch bf16", 48, 8): 8.0, ("combine", 24, 1): 15.0, ("combine", 24, 2): 10.0},
        }[rank]
        best = deepep_normal._agreed_best(mine, device="cpu")
        out.put((rank, best))
    finally:
        dist.destroy_process_group()


def test_deepep_settings_are_agreed_by_every_rank() -> None:
    """DeepEP's calls are collective: the SM count and chunks the comparison runs them with must be
    the same on every rank, even where each rank's own quick timings would pick another (they did,
    and DeepEP then hung or faulted with mismatched channel counts)."""
    import torch.multiprocessing as mp

    from mori_core.bench.ep.measure import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_agree_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results[0] == results[1]
    best = results[0]
    # 24 SMs: chunk 4 averages (10 + 30) / 2 = 20, chunk 8 (30 + 20) / 2 = 25; rank 1 alone picks 8
    assert best[("dispatch bf16", 24)] == (pytest.approx(20.0), 4)
    assert best[("dispatch bf16", 48)] == (pytest.approx(13.0), 6)
    assert best[("combine", 24)] == (pytest.approx(10.5), 2)
    fastest_sms = min((24, 48), key=lambda s: best[("dispatch bf16", s)][0])
    assert fastest_sms == 48


class _HostClockEvent:
    """Stands in for torch.cuda.Event on a machine without a GPU: records the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostClockEvent") -> float:
        return (end.t - self.t) * 1000.0  # ms, as torch's


def test_timed_calls_report_event_call_and_iteration_times(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from mori_core.bench.ep import measure

    monkeypatch.setattr(torch.cuda, "Event", _HostClockEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(0.002)

    us, host_us, loop_us = measure._timed_calls(fn, 6)
    assert len(calls) == 6 and len(us) == 5  # the first call's event time is dropped
    assert all(u >= 2000 for u in us) and host_us >= 2000  # each pair spans the 2 ms call
    assert loop_us >= host_us  # an iteration is the call and its two records
    args = argparse.Namespace(warmup=2, eager_calls=6)
    stats: dict = {}
    median, mean, host = measure.time_eager(fn, args, lambda: None, stats)
    assert len(calls) == 6 + 2 + 6 and median >= 2000 and mean >= 2000 and host >= 2000
    assert stats["loop_us"] >= host
    in_call, loop = measure.host_in_timed_loop(fn, 4)
    assert in_call >= 2000 and loop >= in_call
