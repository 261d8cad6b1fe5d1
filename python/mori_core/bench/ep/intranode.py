"""IntraNode dispatch/combine benchmark (mirrors MORI's bench_dispatch_combine).

``python -m mori_core.bench ep [--world-size 4] [--tokens 128,512,4096] [--dtypes bf16,fp8]``

Spawns one process per rank (placed by :mod:`mori_core.placement`: one per GPU when there are
enough, NCCL group + shmem), builds uniform random top-k routing
(distinct experts per token, uniform over all experts), and times every kernel three ways:

* **eager** -- what a user calling ``op.dispatch(...)`` from Python sees: calls back to back, a
  CUDA event pair around each call, DeepEP's method (``--eager-calls`` calls, the first dropped;
  the table gives the median and, as DeepEP reports, the mean). When the host is slower than the
  kernel this includes the host time, as it does for the user.
* **host** -- wall-clock time the call spends on the host (``time.perf_counter`` around each of
  the same eager calls; median), i.e. Python wrapper + validation + launch.
* **graph** -- CUDA-graph replays of ``--ops-per-graph`` back-to-back launches (median over
  ``--iters`` replays, per op): the kernel alone, as a graph-captured decode step runs it.

Bandwidth counts what a rank receives, MORI/DeepEP style: received tokens (including its own)
x hidden x element size (scales excluded), per rank, averaged over ranks, from the graph time
(and from the eager median in its own column). The NCCL baseline moves the same rows with
``all_to_all_single`` (uneven splits from the same routing) in the same run, eagerly.
``--sms N`` runs every kernel with N blocks (so at most N SMs), for equal-resource comparisons
(e.g. DeepEP's 24-SM setting). ``--sweep`` times a grid of (block_num, warp_per_block).
With more ranks than GPUs (``--world-size 8`` on one GPU) only host times are shown
(:mod:`mori_core.bench.ep.measure`).
"""


from __future__ import annotations

import argparse
import functools
import json
import statistics
from typing import Any, Callable

from mori_core.bench.ep import deepep_normal, extensions, tune, v2
from mori_core.bench.ep.measure import (
    DTYPES, dtype_inputs, host_idle, host_in_timed_loop, measure, merge_ranks, nccl_baseline, progress,
    run_rank, timing_columns_note, token_inputs
)
from mori_core.placement import Placement, placement

SWEEP_BLOCKS = (32, 64, 96, 132, 264)
SWEEP_WARPS = (4, 8, 16)


# ----------------------------------------------------------------------------- per-rank work
def _host_breakdown(op: Any, x: Any, w: Any, idx: Any, args: argparse.Namespace, dev: Any) -> list[dict]:
    """Where the host time of one BF16 dispatch and one combine call goes (GPU idle-waiting):
    the empty-kernel launch floor of this host, the native launch with its arguments already
    extracted, and the full Python call; and each of them inside the eager timer's loop (an event
    pair per call, back to back): the call's own time there and the whole iteration's."""
    import torch

    from mori_core import _C
    from mori_core.ops.call_cache import current_stream_handle

    stream = current_stream_handle(dev.index)
    n = int(x.shape[0])
    calls = max(11, args.eager_calls)
    p = op.get_launch_config(True, n)
    out, out_w, _, _, total = op.dispatch(x, w, None, idx)
    torch.cuda.synchronize()
    recv = int(total[0])
    y = out[: max(recv, 1)].clone()
    pc = op.get_launch_config(False, n, zero_copy=False)
    h = op._handle.address
    xp, wp, ip, yp, owp = x.data_ptr(), w.data_ptr(), idx.data_ptr(), y.data_ptr(), out_w.data_ptr()
    row = int(x.shape[1]) * x.element_size()
    parts = [
        ("nothing (the timed loop's two event records alone)", lambda: None),
        ("empty kernel launch, 4-byte params", lambda: _C.ep_empty_kernel_launch(False, stream)),
        ("empty kernel launch, dispatch-sized params", lambda: _C.ep_empty_kernel_launch(True, stream)),
        ("empty kernel, driver cuLaunchKernel, 4-byte params", lambda: _C.ep_empty_kernel_launch(False, stream, True)),
        ("empty kernel, driver cuLaunchKernel, dispatch-sized", lambda: _C.ep_empty_kernel_launch(True, stream, True)),
        ("native launch_dispatch (arguments ready)",
         lambda: _C.ep_launch_dispatch(h, xp, row, n, wp, 0, ip, p.block_num, p.warp_per_block, stream)),
        ("op.dispatch (full Python call)", lambda: op.dispatch(x, w, None, idx)),
        ("native launch_combine (arguments ready)",
         lambda: _C.ep_launch_combine(h, yp, 0, int(x.shape[1]), int(y.shape[0]), owp, int(out_w.shape[0]), ip, n,
                                      True, pc.block_num, pc.warp_per_block, stream)),
        ("op.combine (full Python call)", lambda: op.combine(y, out_w, idx, use_external_inp_buf=1)),
    ]
    rows = []
    for name, fn in parts:
        in_loop, loop = host_in_timed_loop(fn, calls)
        rows.append(dict(table="breakdown", part=name, tokens=n, host_us=host_idle(fn, calls), loop_call_us=in_loop,
                         loop_us=loop))
    op.check_error()
    return rows


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """Entry of one spawned rank: time every kernel at every token count; puts ``(rank, rows, error)`` on ``results``."""
    run_rank(rank, world, port, results, functools.partial(_rank_rows, rank, world, args))


def _open_deepep(args: argparse.Namespace, world: int, op: Any) -> Any:
    """Collective: the DeepEP baseline when ``--deepep`` asks for it and ``deep_ep`` imports on
    every rank, else None (rank 0 prints why)."""
    if not getattr(args, "deepep", False):
        return None
    import torch
    import torch.distributed as dist

    ok, why = deepep_normal.available()
    if placement(world).shared:  # DeepEP needs a GPU per rank (NCCL, its IPC buffers)
        ok, why = False, "the ranks share GPUs"
    votes = [None] * world
    dist.all_gather_object(votes, ok)
    if not all(votes):
        if op.config.rank == 0:
            print(f"--deepep: skipped, {why or 'deep_ep is not importable on every rank'}", flush=True)
        return None
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return deepep_normal.DeepEpNormal(dist.group.WORLD, world, args.hidden, args, sms)


COMBINE_CALLS = {"default": -1, "push": 1, "pull": 0}  # use_external_inp_buf of each combine row


def _rank_rows(rank: int, world: int, args: argparse.Namespace, dev: Any, sync: Callable[[], None]) -> list[dict]:
    """The rows of one rank (collective: every rank runs the same calls)."""
    import torch

    from mori_core.ops import EpDispatchCombineConfig, EpDispatchCombineOp

    tokens = [int(t) for t in args.tokens.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    max_type = max(torch.empty(0, dtype=getattr(torch, DTYPES[d])).element_size() for d in dtypes + ["bf16"])
    cfg = EpDispatchCombineConfig(
        data_type=torch.bfloat16,
        rank=rank,
        world_size=world,
        hidden_dim=args.hidden,
        scale_dim=args.scale_dim if "fp8" in dtypes else 0,
        scale_type_size=4,
        max_token_type_size=max_type,
        max_num_inp_token_per_rank=max(tokens),
        num_experts_per_rank=args.experts // world,
        num_experts_per_token=args.topk,
    )
    progress(rank, "op")
    op = EpDispatchCombineOp(cfg)
    v2_ops = v2.make_ops(cfg, args)  # --v2: EPv2 ops on the same heap
    progress(rank, "DeepEP buffer" if getattr(args, "deepep", False) else "start")
    dp = _open_deepep(args, world, op)

    calls = {"0": ["default", "push"], "1": ["default", "pull"], "both": ["default", "push", "pull"]}[args.zero_copy]
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    for n in tokens:
        idx, x_bf16, w = token_inputs(n, args, gen, dev)
        inputs = {"idx": idx, "x": x_bf16, "w": w}
        for dname in dtypes:
            progress(rank, f"{n} tokens: dispatch {dname}")
            x, scales = dtype_inputs(x_bf16, dname, cfg.scale_dim, dev)
            if dname == "fp8":
                inputs.update(x8=x, s8=scales)
            launches = [(args.sms or args.dispatch_block_num, args.dispatch_warp_per_block)]
            if args.sweep and "dispatch" in args.sweep_kernels.split(","):
                launches = [(b, wp) for b in SWEEP_BLOCKS for wp in SWEEP_WARPS]
            res = op.dispatch(x, w, scales, idx)
            torch.cuda.synchronize()
            recv = int(res[4][0])
            for bn, wpb in launches:
                fn = lambda: op.dispatch(x, w, scales, idx, block_num=bn, warp_per_block=wpb)
                fn()
                p = op._cached_dispatch_launch
                rows.append(measure(
                    fn, args, sync, kernel="dispatch", dtype=dname, tokens=n, recv=recv,
                    bytes=recv * args.hidden * x.element_size(), blocks=p.block_num, warps=p.warp_per_block, mode="-",
                ))
        # combine (bf16), after a bf16 dispatch so the routing state matches; experts: rows x (rank + 1)
        progress(rank, f"{n} tokens: combine")
        out, out_w, _, _, total = op.dispatch(x_bf16, w, None, idx)
        torch.cuda.synchronize()
        recv = int(total[0])
        y = (out[: max(recv, 1)].to(torch.float32) * (rank + 1)).to(torch.bfloat16)
        reg = op.get_registered_combine_input_buffer(torch.bfloat16)
        reg[:recv].copy_(y[:recv])
        inputs.update(y=y, out_w=out_w, recv=recv)
        for call in calls:
            launches = [(args.sms or args.combine_block_num, args.combine_warp_per_block)]
            if args.sweep and "combine" in args.sweep_kernels.split(","):
                launches = [(b, wp) for b in SWEEP_BLOCKS for wp in SWEEP_WARPS if wp <= 16]
            for bn, wpb in launches:
                uib = COMBINE_CALLS[call]
                inp = reg if uib == 0 else y
                fn = lambda: op.combine(inp, out_w, idx, block_num=bn, warp_per_block=wpb, use_external_inp_buf=uib)
                fn()
                p = op._cached_combine_launch
                rows.append(measure(
                    fn, args, sync, kernel="combine", dtype="bf16", tokens=n, recv=recv, bytes=recv * args.hidden * 2,
                    blocks=p.block_num, warps=p.warp_per_block, mode=f"{call} call, {KERNEL_NAMES[p.mode]} kernel",
                ))
        op.check_error()
        if n == tokens[0]:
            rows.extend(_host_breakdown(op, x_bf16, w, idx, args, dev))
        progress(rank, f"{n} tokens: FP8 combine / standard MoE")
        rows.extend(extensions.extension_rows(op, cfg, args, n, x_bf16, w, idx, measure, sync))
        rows.extend(v2.rows(v2_ops, args, n, x_bf16, w, idx, measure, sync))
        if dp is not None:
            progress(rank, f"{n} tokens: DeepEP")
            rows.extend(deepep_normal.compare(dp, op, n, inputs, args, sync))
        progress(rank, f"{n} tokens: tune" if args.tune else f"{n} tokens: NCCL")
        rows.extend(tune.rows(op, cfg, args, n, inputs, sync))
        if not args.no_nccl:
            rows.extend(nccl_baseline(idx, n, x_bf16, cfg, args, sync, dev))
    sync()
    if dp is not None:
        dp.destroy()
    v2.close(v2_ops)
    op.close()
    return rows


KERNEL_NAMES = {0: "pull", 1: "push", 2: "copy-pull", 3: "pull (small rounds push)", -1: "-"}


# ----------------------------------------------------------------------------- driver
def report(per_rank: dict[int, list[dict]], args: argparse.Namespace, world: int, where: Placement) -> int:
    """Print the tables of the gathered rows (host time only when ranks share a GPU)."""
    import torch

    from mori_core.bench.table import print_table

    breakdown = {r: [x for x in rows if x.get("table") == "breakdown"] for r, rows in per_rank.items()}
    side = {r: [x for x in rows if x.get("table") in SIDE_TABLES] for r, rows in per_rank.items()}
    per_rank = {r: [x for x in rows if "table" not in x] for r, rows in per_rank.items()}
    merged = merge_ranks(per_rank)
    name = torch.cuda.get_device_name(0)
    gpus = f"{where.num_gpus}x {name}" + (f" ({where.ranks_per_gpu} ranks per GPU)" if where.shared else "")
    grid = f"--sms {args.sms} (every kernel {args.sms} blocks)" if args.sms else ("AUTO launch table" if args.auto else "config/explicit launch")
    title = f"EP{world} on {gpus}: hidden {args.hidden}, top-{args.topk} of {args.experts}, uniform routing, {grid}"
    if not where.shared:
        title += (f"; eager = event pair around each of {args.eager_calls} back-to-back calls (first dropped), "
                  f"graph = replay of {args.ops_per_graph} ops, median of {args.iters}")
    headers = ["kernel", "mode", "dtype", "tokens", "recv/rank", "blocks x warps", "eager us (median)",
               "eager us (mean)", "host us/call", "host loop us/iter", "graph us", "GB/s (eager)", "GB/s (graph)"]
    timed = not where.shared  # latency and bandwidth mean nothing when ranks share a GPU
    title += "" if timed else f"; host us/call = median of {args.eager_calls - 1} eager calls"
    if not timed:
        headers = headers[:6] + ["host us/call"]

    def table_row(m: dict) -> list:
        grid = f"{m['blocks']}x{m['warps']}" if m["blocks"] else "-"
        graph = m["graph_us"] if m["graph_us"] is not None else "-"
        gbps_graph = m["gbps"] if m["graph_us"] is not None else "-"
        row = [m["kernel"], m["mode"], m["dtype"], m["tokens"], round(m["recv"]), grid]
        if not timed:
            return row + [m["host_us"]]
        return row + [m["eager_us"], m["eager_mean_us"], m["host_us"], m.get("loop_us", "-"), graph, m["gbps_eager"],
                      gbps_graph]

    note = timing_columns_note(where) or (
        "GB/s = received tokens (incl. local) x hidden x element size / time, mean over ranks; "
        "times are means over ranks of per-rank medians; NCCL rows are eager only; host loop = the host's wall "
        "time per timed iteration (call + two event records): where it is >= the eager latency, the GPU waited "
        "for the host and eager measures the host")
    if args.sweep:
        print_table(title + " (sweep, all)", headers, [table_row(m) for m in merged])
        print_table(title + " (sweep, best per kernel)", headers, [table_row(m) for m in _best(merged)])
    else:
        print_table(title, headers, [table_row(m) for m in merged], note=note)
    ranks = sorted(breakdown)
    if ranks and breakdown[ranks[0]]:
        def host_row(i: int, part: str) -> list:
            """A part's columns, means over ranks ("-" where a rank's row lacks the loop figures)."""
            keys = ("host_us", "loop_call_us", "loop_us")
            if any(k not in breakdown[r][i] for r in ranks for k in keys):
                return [part, statistics.mean(breakdown[r][i]["host_us"] for r in ranks), "-", "-", "-"]
            host, call, loop = (statistics.mean(breakdown[r][i][k] for r in ranks) for k in keys)
            return [part, host, call, loop, loop - call]

        print_table(
            f"Host time of one call, BF16, {breakdown[ranks[0]][0]['tokens']} tokens/rank "
            f"(us, median of {max(11, args.eager_calls) - 1}, mean over ranks)",
            ["part", "host us (GPU idle before each call)", "in the eager loop: the call", "the iteration",
             "iteration - call"],
            [host_row(i, b["part"]) for i, b in enumerate(breakdown[ranks[0]])],
            note="'arguments ready' = the native launch call (_C.ep_launch_*) with pointers/sizes already extracted; "
                 "the rest of the full call is the Python wrapper (argument checks, cached views, stream lookup). "
                 "'in the eager loop' = back to back, an event pair around each call (the eager timer's loop): "
                 "'iteration - call' is what the two event records and the loop cost around that call",
        )
    extensions.print_extension_tables(per_rank, f"EP{world} on {gpus}", where)
    tune.print_tables(side, f"EP{world} on {gpus}")
    best = deepep_normal.print_tables(side, f"EP{world} on {gpus}") if timed else []
    if timed:
        _print_targets(world, best, merged, f"EP{world} on {gpus}")
    if args.plot:
        _plot(args.plot, f"EP{world} on {gpus}, hidden {args.hidden}, top-{args.topk} of {args.experts}", merged,
              deepep_normal.merged_rows(side, "deepep"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "device": name, "gpus": where.num_gpus, "ranks_per_gpu": where.ranks_per_gpu,
                       "args": vars(args), "rows": merged, "per_rank": per_rank, "host_breakdown": breakdown,
                       "side_tables": side}, f, indent=1)
    return 0


SIDE_TABLES = ("deepep", "deepep_check", "deepep_kernels", "tune")
# Issue #31's targets: DeepEP's best time / ours, by (EP size, tokens per rank); 128 tokens: every EP size.
DEEPEP_TARGETS = {(4, 4096): 1.3, (4, 512): 1.3, (2, 4096): 1.4}
SMALL_BATCH_TARGET = (128, 1.6)
FP8_COMBINE_TARGET = 1.5  # FP8 combine of the default call vs the best BF16 combine (EP4 x 4096)
STD_MOE_TARGET = 1.3  # dispatch_standard_moe / 2-D dispatch, 128 tokens (at most)


def _print_targets(world: int, best: list[dict], merged: list[dict], title: str) -> None:
    """The issue's targets next to what this run measured (eager means, mean over ranks)."""
    from mori_core.bench.table import print_table

    lines = []
    for b in best:
        target = DEEPEP_TARGETS.get((world, b["tokens"]))
        if b["tokens"] == SMALL_BATCH_TARGET[0]:
            target = SMALL_BATCH_TARGET[1]
        lines.append([b["tokens"], f"{b['kernel']} vs DeepEP best", f"{b['ratio']:.2f}x",
                      f">= {target}x" if target else "-", "-" if not target else ("yes" if b["ratio"] >= target else "no")])
    ext = [m for m in merged if m.get("ext") == "fp8"]
    for n in sorted({m["tokens"] for m in ext}):
        bf16 = [m["eager_mean_us"] for m in ext if m["tokens"] == n and m["kernel"] == "combine bf16"]
        for q in ("fp8_direct_cast", "fp8_blockwise"):
            fp8 = [m["eager_mean_us"] for m in ext if m["tokens"] == n and m["kernel"] == f"combine {q}" and
                   m["mode"] == "push"]
            if bf16 and fp8:
                ratio = min(bf16) / fp8[0]
                target = FP8_COMBINE_TARGET if (world, n) == (4, 4096) else None
                lines.append([n, f"{q} combine (default call) vs best BF16 combine", f"{ratio:.2f}x",
                              f">= {target}x" if target else "-",
                              "-" if not target else ("yes" if ratio >= target else "no")])
    std = {m["kernel"]: m for m in merged if m.get("ext") == "std" and m["tokens"] == 128}
    base = std.get("dispatch (same op)")
    # Whole calls only: the --std-kernel-times rows ("...: kernel ...") are parts of a call.
    for name in (k for k in std if k.startswith("dispatch_standard_moe") and "combine" not in k and ": kernel " not in k):
        if base is None:
            continue
        eager = std[name]["eager_mean_us"] / base["eager_mean_us"]
        g, g0 = std[name].get("graph_us"), base.get("graph_us")
        graph = g / g0 if g and g0 else None
        # At 128 tokens the 2-D dispatch's eager time can be the host's loop (more than its kernel
        # takes), which flatters the eager ratio; the kernels' ratio (graph replays) must meet it too.
        worst = max(eager, graph or 0.0)
        shown = f"{eager:.2f}x eager" + (f", {graph:.2f}x graph" if graph else "")
        lines.append([128, f"{name} / 2-D dispatch", shown, f"<= {STD_MOE_TARGET}x",
                      "yes" if worst <= STD_MOE_TARGET else "no"])
    if lines:
        print_table(title + ": issue #31 targets (DeepEP's bench() means; FP8 rows: eager means; standard-MoE "
                    "rows: eager means and graph replays)", ["tokens", "what", "measured", "target", "met"], lines)


def _plot(path: str, title: str, merged: list[dict], deepep_rows: list[dict]) -> None:
    """Eager time per call against tokens per rank: ours, DeepEP at its best, NCCL (``--plot``)."""
    import sys

    from mori_core.bench.plot import Panel, PlotUnavailable, write_png

    ours = {(r["kernel"], r["tokens"]): r["mean_us"] for r in deepep_rows if r["lib"] == "ours" and r["sms"] == 0}
    theirs: dict[tuple[str, int], float] = {}
    for r in deepep_rows:
        if r["lib"] == "deepep" and "top-k" not in r["kernel"]:
            key = (r["kernel"], r["tokens"])
            theirs[key] = min(theirs.get(key, float("inf")), r["mean_us"])

    def main(kernel: str, dtype: str, mode_prefix: str = "") -> list[tuple[int, float]]:
        return [(m["tokens"], m["eager_mean_us"]) for m in merged if m["kernel"] == kernel and m["dtype"] == dtype and
                "ext" not in m and m["mode"].startswith(mode_prefix)]

    def pick(name: str, fallback: list[tuple[int, float]]) -> list[tuple[int, float]]:
        pts = [(n, t) for (k, n), t in ours.items() if k == name]
        return pts or fallback

    panels = []
    for dtype in ("fp8", "bf16"):
        panel = Panel(f"dispatch {dtype.upper()}", "tokens per rank", "us per call (eager mean)", ylog=True)
        panel.add("ours", pick(f"dispatch {dtype}", main("dispatch", dtype)))
        panel.add("DeepEP (best SMs, chunk)", [(n, t) for (k, n), t in theirs.items() if k == f"dispatch {dtype}"], True)
        if dtype == "bf16":
            panel.add("NCCL all_to_all_single", main("nccl a2a (dispatch)", "bf16"), True)
        panels.append(panel)
    panel = Panel("combine BF16", "tokens per rank", "us per call (eager mean)", ylog=True)
    for call in ("default", "push", "pull"):
        name = "combine (default call)" if call == "default" else f"combine {call}"
        panel.add(f"ours, {call} call", pick(name, main("combine", "bf16", call)))
    panel.add("DeepEP (best SMs, chunk)", [(n, t) for (k, n), t in theirs.items() if k == "combine"], True)
    panel.add("NCCL all_to_all_single", main("nccl a2a (combine)", "bf16"), True)
    panels.append(panel)
    ext = [m for m in merged if m.get("ext") == "fp8"]
    panel = Panel("FP8 combine (ours, same run)", "tokens per rank", "us per call (eager mean)", ylog=True)
    for kernel in ("combine fp8_direct_cast", "combine fp8_blockwise", "combine bf16"):
        for mode in ("push", "pull"):
            panel.add(f"{kernel[8:]}, {mode} call",
                      [(m["tokens"], m["eager_mean_us"]) for m in ext if m["kernel"] == kernel and m["mode"] == mode],
                      baseline=kernel == "combine bf16")
    panels.append(panel)
    std = [m for m in merged if m.get("ext") == "std"]
    panel = Panel("standard-MoE layout (ours)", "tokens per rank", "us per call (eager mean)", ylog=True)
    for kernel in ("dispatch_standard_moe", "dispatch (same op)"):
        panel.add(kernel, [(m["tokens"], m["eager_mean_us"]) for m in std if m["kernel"] == kernel],
                  baseline=kernel != "dispatch_standard_moe")
    panels.append(panel)
    try:
        print(f"wrote {write_png(path, title, panels)}", flush=True)
    except (PlotUnavailable, ValueError) as e:
        print(e, file=sys.stderr)


def _best(rows: list[dict]) -> list[dict]:
    """The fastest row per (kernel, mode, dtype, tokens) of a sweep."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kernel"], r["mode"], r["dtype"], r["tokens"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return list(best.values())
