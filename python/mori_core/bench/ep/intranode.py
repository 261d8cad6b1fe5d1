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

from mori_core.bench.ep import extensions, v2
from mori_core.bench.ep.measure import (
    DTYPES, dtype_inputs, host_idle, measure, merge_ranks, nccl_baseline,
    run_rank, timing_columns_note, token_inputs
)
from mori_core.placement import Placement

SWEEP_BLOCKS = (32, 64, 96, 132, 264)
SWEEP_WARPS = (4, 8, 16)


# ----------------------------------------------------------------------------- per-rank work
def _host_breakdown(op: Any, x: Any, w: Any, idx: Any, args: argparse.Namespace, dev: Any) -> list[dict]:
    """Where the host time of one BF16 dispatch and one combine call goes (GPU idle-waiting):
    the empty-kernel launch floor of this host, the native launch with its arguments already
    extracted, and the full Python call."""
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
        rows.append(dict(table="breakdown", part=name, tokens=n, host_us=host_idle(fn, calls)))
    op.check_error()
    return rows


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """Entry of one spawned rank: time every kernel at every token count; puts ``(rank, rows, error)`` on ``results``."""
    run_rank(rank, world, port, results, functools.partial(_rank_rows, rank, world, args))


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
    op = EpDispatchCombineOp(cfg)
    v2_ops = v2.make_ops(cfg, args)  # --v2: EPv2 ops on the same heap

    modes = {"0": [True], "1": [False], "both": [True, False]}[args.zero_copy]
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    for n in tokens:
        idx, x_bf16, w = token_inputs(n, args, gen, dev)
        for dname in dtypes:
            x, scales = dtype_inputs(x_bf16, dname, cfg.scale_dim, dev)
            launches = [(args.sms or args.dispatch_block_num, args.dispatch_warp_per_block)]
            if args.sweep:
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
        # combine (bf16), after a bf16 dispatch so the routing state matches
        out, out_w, _, _, total = op.dispatch(x_bf16, w, None, idx)
        torch.cuda.synchronize()
        recv = int(total[0])
        y = out[: max(recv, 1)].clone()
        reg = op.get_registered_combine_input_buffer(torch.bfloat16)
        reg[:recv].copy_(out[:recv])
        for push in modes:
            launches = [(args.sms or args.combine_block_num, args.combine_warp_per_block)]
            if args.sweep:
                launches = [(b, wp) for b in SWEEP_BLOCKS for wp in SWEEP_WARPS if wp <= 16]
            for bn, wpb in launches:
                inp = y if push else reg
                fn = lambda: op.combine(inp, out_w, idx, block_num=bn, warp_per_block=wpb, use_external_inp_buf=int(push))
                fn()
                p = op._cached_combine_launch
                rows.append(measure(
                    fn, args, sync, kernel="combine", dtype="bf16", tokens=n, recv=recv, bytes=recv * args.hidden * 2,
                    blocks=p.block_num, warps=p.warp_per_block, mode="push" if push else "pull",
                ))
        op.check_error()
        if n == tokens[0]:
            rows.extend(_host_breakdown(op, x_bf16, w, idx, args, dev))
        rows.extend(extensions.extension_rows(op, cfg, args, n, x_bf16, w, idx, measure, sync))
        rows.extend(v2.rows(v2_ops, args, n, x_bf16, w, idx, measure, sync))
        if not args.no_nccl:
            rows.extend(nccl_baseline(idx, n, x_bf16, cfg, args, sync, dev))
    sync()
    v2.close(v2_ops)
    op.close()
    return rows


# ----------------------------------------------------------------------------- driver
def report(per_rank: dict[int, list[dict]], args: argparse.Namespace, world: int, where: Placement) -> int:
    """Print the tables of the gathered rows (host time only when ranks share a GPU)."""
    import torch

    from mori_core.bench.table import print_table

    breakdown = {r: [x for x in rows if x.get("table") == "breakdown"] for r, rows in per_rank.items()}
    per_rank = {r: [x for x in rows if x.get("table") != "breakdown"] for r, rows in per_rank.items()}
    merged = merge_ranks(per_rank)
    name = torch.cuda.get_device_name(0)
    gpus = f"{where.num_gpus}x {name}" + (f" ({where.ranks_per_gpu} ranks per GPU)" if where.shared else "")
    grid = f"--sms {args.sms} (every kernel {args.sms} blocks)" if args.sms else ("AUTO launch table" if args.auto else "config/explicit launch")
    title = f"EP{world} on {gpus}: hidden {args.hidden}, top-{args.topk} of {args.experts}, uniform routing, {grid}"
    if not where.shared:
        title += (f"; eager = event pair around each of {args.eager_calls} back-to-back calls (first dropped), "
                  f"graph = replay of {args.ops_per_graph} ops, median of {args.iters}")
    headers = ["kernel", "mode", "dtype", "tokens", "recv/rank", "blocks x warps", "eager us (median)",
               "eager us (mean)", "host us/call", "graph us", "GB/s (eager)", "GB/s (graph)"]
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
        return row + [m["eager_us"], m["eager_mean_us"], m["host_us"], graph, m["gbps_eager"], gbps_graph]

    note = timing_columns_note(where) or (
        "GB/s = received tokens (incl. local) x hidden x element size / time, mean over ranks; "
        "times are means over ranks of per-rank medians; NCCL rows are eager only")
    if args.sweep:
        print_table(title + " (sweep, all)", headers, [table_row(m) for m in merged])
        print_table(title + " (sweep, best per kernel)", headers, [table_row(m) for m in _best(merged)])
    else:
        print_table(title, headers, [table_row(m) for m in merged], note=note)
    ranks = sorted(breakdown)
    if ranks and breakdown[ranks[0]]:
        print_table(
            f"Host time of one call, BF16, {breakdown[ranks[0]][0]['tokens']} tokens/rank, GPU idle before each call "
            f"(us, median of {max(11, args.eager_calls) - 1}, mean over ranks)",
            ["part", "host us"],
            [[b["part"], statistics.mean(breakdown[r][i]["host_us"] for r in ranks)] for i, b in enumerate(breakdown[ranks[0]])],
            note="'arguments ready' = the native launch call (_C.ep_launch_*) with pointers/sizes already extracted; "
                 "the rest of the full call is the Python wrapper (argument checks, cached views, stream lookup)",
        )
    extensions.print_extension_tables(per_rank, f"EP{world} on {gpus}", where)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "device": name, "gpus": where.num_gpus, "ranks_per_gpu": where.ranks_per_gpu,
                       "args": vars(args), "rows": merged, "per_rank": per_rank, "host_breakdown": breakdown}, f,
                      indent=1)
    return 0


def _best(rows: list[dict]) -> list[dict]:
    """The fastest row per (kernel, mode, dtype, tokens) of a sweep."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kernel"], r["mode"], r["dtype"], r["tokens"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return list(best.values())
