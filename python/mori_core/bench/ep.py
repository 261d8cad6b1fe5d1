"""MORI-EP dispatch/combine benchmark (mirrors MORI's bench_dispatch_combine).

``python -m mori_core.bench ep [--world-size 4] [--tokens 128,512,4096] [--dtypes bf16,fp8]``

Spawns one process per GPU (NCCL group + shmem), builds uniform random top-k routing
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
``--v2`` adds the EPv2 API's rows (:mod:`mori_core.bench.ep_v2`) beside the v1 rows of the same run.
``--sms N`` runs every kernel with N blocks (so at most N SMs), for equal-resource comparisons
(e.g. DeepEP's 24-SM setting). ``--sweep`` times a grid of (block_num, warp_per_block).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from typing import Any, Optional

from mori_core.bench import ep_extensions, ep_v2

DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp32": "float32"}
SWEEP_BLOCKS = (32, 64, 96, 132, 264)
SWEEP_WARPS = (4, 8, 16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    p.add_argument("--world-size", type=int, default=0, help="GPUs/ranks (default: all visible)")
    p.add_argument("--tokens", default="128,512,4096", help="tokens per rank, comma separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256, help="total experts")
    p.add_argument("--dtypes", default="bf16,fp8", help="dispatch dtypes: bf16, fp8 (with fp32 scales), fp32")
    p.add_argument("--scale-dim", type=int, default=56, help="fp32 scales per token for fp8 dispatch")
    p.add_argument("--zero-copy", default="both", choices=["0", "1", "both"], help="combine: 1 = pull, 0 = push")
    p.add_argument("--dispatch-block-num", type=int, default=-1)
    p.add_argument("--dispatch-warp-per-block", type=int, default=-1)
    p.add_argument("--combine-block-num", type=int, default=-1)
    p.add_argument("--combine-warp-per-block", type=int, default=-1)
    p.add_argument("--auto", action="store_true", help="MORI_EP_LAUNCH_CONFIG_MODE=AUTO (tuned table)")
    p.add_argument(
        "--sms", type=int, default=0,
        help="run every kernel with this many blocks (at most this many SMs); overrides --*-block-num and AUTO",
    )
    p.add_argument("--iters", type=int, default=20, help="graph replays per measurement")
    p.add_argument("--ops-per-graph", type=int, default=10, help="back-to-back launches per captured graph")
    p.add_argument("--eager-calls", type=int, default=50, help="eager calls per measurement (first one dropped)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing (eager and host only)")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL all_to_all_single baseline")
    p.add_argument("--sweep", action="store_true", help="sweep (block_num, warp_per_block) per kernel")
    p.add_argument("--json", default="", help="write all measurements to this file")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kernel-type", default="IntraNode",
                   help="comma-separated kernel types; any inter-node type (InterNode, InterNodeV1, InterNodeV1LL, "
                        "AsyncLL) runs the inter-node benchmark (mori_core.bench.ep_internode)")
    p.add_argument("--gpu-per-node", type=int, default=0, help="inter-node types: GPUs per node (default: all)")
    p.add_argument("--rdma-block-num", type=int, default=-1, help="inter-node V1/V1LL: blocks staging network rows")
    ep_extensions.add_arguments(p)
    ep_v2.add_arguments(p)


# ----------------------------------------------------------------------------- per-rank work
def _routing(n: int, experts: int, topk: int, gen: Any, device: Any) -> Any:
    import torch

    scores = torch.rand(n, experts, generator=gen, device="cpu")
    return scores.topk(topk, dim=1).indices.to(torch.int32).to(device)


def _time_eager(fn: Any, args: argparse.Namespace, sync: Any) -> tuple[float, float, float]:
    """Eager per-call latency, DeepEP's method: calls back to back, an event pair around each.

    Returns ``(median us, mean us, host median us)`` over ``eager_calls - 1`` calls (the first
    is dropped). Host time is ``perf_counter`` around the call itself, inside the event pair."""
    import torch

    n = max(2, args.eager_calls)
    for _ in range(args.warmup):
        fn()
    sync()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    host_ns = []
    for i in range(n):
        starts[i].record()
        t0 = time.perf_counter_ns()
        fn()
        host_ns.append(time.perf_counter_ns() - t0)
        ends[i].record()
    torch.cuda.synchronize()
    us = [s.elapsed_time(e) * 1000 for s, e in zip(starts, ends)][1:]
    return statistics.median(us), statistics.mean(us), statistics.median(host_ns[1:]) / 1000


def _time_graph(fn: Any, args: argparse.Namespace, sync: Any) -> Optional[float]:
    """Median microseconds per op of ``fn`` (one launch), captured ``ops_per_graph`` times;
    None with ``--no-graph``."""
    import torch

    if args.no_graph:
        return None
    k = args.ops_per_graph
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(k):
            fn()
    torch.cuda.synchronize()
    g.replay()  # warm replay
    torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / k)
    del g
    return statistics.median(times)


def _measure(fn: Any, args: argparse.Namespace, sync: Any, **row: Any) -> dict:
    """One table row: eager (median, mean), host and graph times of ``fn``."""
    eager, eager_mean, host = _time_eager(fn, args, sync)
    graph = _time_graph(fn, args, sync)
    return dict(row, eager_us=eager, eager_mean_us=eager_mean, host_us=host, us=graph if graph is not None else eager,
                graph_us=graph)


def _host_idle(fn: Any, calls: int) -> float:
    """Median host microseconds of ``fn`` with the GPU idle before every call (synchronised)."""
    import torch

    ns = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        ns.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(ns[1:]) / 1000


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
         lambda: _C.ep_launch_combine(h, yp, 0, int(x.shape[1]), int(y.shape[0]), owp, int(out_w.shape[0]), True, ip, n,
                                      True, pc.block_num, pc.warp_per_block, stream)),
        ("op.combine (full Python call)", lambda: op.combine(y, out_w, idx, use_external_inp_buf=1)),
    ]
    rows = []
    for name, fn in parts:
        rows.append(dict(table="breakdown", part=name, tokens=n, host_us=_host_idle(fn, calls)))
    op.check_error()
    return rows


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev
        )
        torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
        import mori_core.shmem as shmem
        from mori_core.ops import EpDispatchCombineConfig, EpDispatchCombineOp

        shmem.shmem_torch_process_group_init("default")
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
        v2_ops = ep_v2.make_ops(cfg, args)  # --v2: EPv2 ops on the same heap

        def sync() -> None:
            torch.cuda.synchronize()
            dist.barrier()

        modes = {"0": [True], "1": [False], "both": [True, False]}[args.zero_copy]
        rows: list[dict] = []
        gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
        for n in tokens:
            idx = _routing(n, args.experts, args.topk, gen, dev)
            x_bf16 = torch.randn(n, args.hidden, generator=gen).to(torch.bfloat16).to(dev)
            w = torch.rand(n, args.topk, generator=gen).to(dev)
            for dname in dtypes:
                dt = getattr(torch, DTYPES[dname])
                x = x_bf16.to(dt) if dname != "fp8" else x_bf16.clamp(-6, 6).to(dt)
                scales = torch.rand(n, cfg.scale_dim, device=dev) if dname == "fp8" and cfg.scale_dim else None
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
                    rows.append(_measure(
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
                    rows.append(_measure(
                        fn, args, sync, kernel="combine", dtype="bf16", tokens=n, recv=recv, bytes=recv * args.hidden * 2,
                        blocks=p.block_num, warps=p.warp_per_block, mode="push" if push else "pull",
                    ))
            op.check_error()
            if n == tokens[0]:
                rows.extend(_host_breakdown(op, x_bf16, w, idx, args, dev))
            rows.extend(ep_extensions.extension_rows(op, cfg, args, n, x_bf16, w, idx, _measure, sync))
            rows.extend(ep_v2.rows(v2_ops, args, n, x_bf16, w, idx, _measure, sync))
            if not args.no_nccl:
                rows.extend(_nccl_baseline(idx, n, x_bf16, cfg, args, sync, dev))
        sync()
        ep_v2.close(v2_ops)
        op.close()
        shmem.shmem_finalize()
        results.put((rank, rows, None))
    except BaseException:
        results.put((rank, [], traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _nccl_baseline(idx: Any, n: int, x: Any, cfg: Any, args: argparse.Namespace, sync: Any, dev: Any) -> list[dict]:
    """all_to_all_single of the same per-destination rows (deduplicated per rank), both ways."""
    import torch
    import torch.distributed as dist

    world = cfg.world_size
    e = idx.to(torch.int64)
    dest = e // cfg.num_experts_per_rank
    mask = torch.zeros(n, world + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :world]
    send_counts = mask.sum(0).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    order = torch.cat([torch.nonzero(mask[:, r]).flatten() for r in range(world)])
    send = x.index_select(0, order).contiguous()
    recv = torch.empty(sum(rc), x.shape[1], dtype=x.dtype, device=dev)
    fwd = lambda: dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=sc)
    back = lambda: dist.all_to_all_single(send, recv, output_split_sizes=sc, input_split_sizes=rc)
    out = []
    nbytes = sum(rc) * x.shape[1] * x.element_size()
    # Eager only: NCCL inside CUDA graphs is not relied on.
    eager = argparse.Namespace(**{**vars(args), "no_graph": True})
    for name, fn in (("nccl a2a (dispatch)", fwd), ("nccl a2a (combine)", back)):
        out.append(_measure(fn, eager, sync, kernel=name, dtype="bf16", tokens=n, recv=sum(rc), bytes=nbytes, blocks=0,
                            warps=0, mode="-"))
    return out


# ----------------------------------------------------------------------------- driver
def run(args: argparse.Namespace) -> int:
    """Spawn the ranks, gather per-rank rows, print the tables."""
    import torch

    from mori_core.bench.table import print_table

    if args.auto:
        os.environ["MORI_EP_LAUNCH_CONFIG_MODE"] = "AUTO"
    if args.kernel_type != "IntraNode":
        from mori_core.bench.ep_internode import run_internode

        return run_internode(args)
    world = args.world_size or torch.cuda.device_count()
    if world < 1:
        print("ep benchmark: no GPU visible")
        return 2
    per_rank = spawn_ranks(_rank_main, world, args)
    if per_rank is None:
        return 1
    breakdown = {r: [x for x in rows if x.get("table") == "breakdown"] for r, rows in per_rank.items()}
    per_rank = {r: [x for x in rows if x.get("table") != "breakdown"] for r, rows in per_rank.items()}
    merged = _merge(per_rank)
    name = torch.cuda.get_device_name(0)
    grid = f"--sms {args.sms} (every kernel {args.sms} blocks)" if args.sms else ("AUTO launch table" if args.auto else "config/explicit launch")
    title = (
        f"EP{world} on {world}x {name}: hidden {args.hidden}, top-{args.topk} of {args.experts}, uniform routing, {grid}; "
        f"eager = event pair around each of {args.eager_calls} back-to-back calls (first dropped), "
        f"graph = replay of {args.ops_per_graph} ops, median of {args.iters}"
    )
    headers = ["kernel", "mode", "dtype", "tokens", "recv/rank", "blocks x warps", "eager us (median)",
               "eager us (mean)", "host us/call", "graph us", "GB/s (eager)", "GB/s (graph)"]

    def table_row(m: dict) -> list:
        grid = f"{m['blocks']}x{m['warps']}" if m["blocks"] else "-"
        graph = m["graph_us"] if m["graph_us"] is not None else "-"
        gbps_graph = m["gbps"] if m["graph_us"] is not None else "-"
        return [m["kernel"], m["mode"], m["dtype"], m["tokens"], round(m["recv"]), grid, m["eager_us"], m["eager_mean_us"],
                m["host_us"], graph, m["gbps_eager"], gbps_graph]

    note = ("GB/s = received tokens (incl. local) x hidden x element size / time, mean over ranks; "
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
    ep_extensions.print_extension_tables(per_rank, f"EP{world} on {world}x {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "device": name, "args": vars(args), "rows": merged, "per_rank": per_rank,
                       "host_breakdown": breakdown}, f, indent=1)
    return 0


def spawn_ranks(rank_main: Any, world: int, args: argparse.Namespace) -> Optional[dict[int, list[dict]]]:
    """Run ``rank_main(rank, world, port, args, queue)`` in one spawned process per GPU and gather
    each rank's rows (the EP benchmarks' driver). Returns None after printing the ranks' errors."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank: dict[int, list[dict]] = {}
    errors = []
    for _ in range(world):
        rank, rows, err = q.get(timeout=3600)
        per_rank[rank] = rows
        if err:
            errors.append(f"rank {rank}:\n{err}")
    for p in procs:
        p.join(timeout=60)
    if errors:
        print("\n".join(errors))
        return None
    return per_rank


def _merge(per_rank: dict[int, list[dict]]) -> list[dict]:
    ranks = sorted(per_rank)
    out = []
    for i, row in enumerate(per_rank[ranks[0]]):
        rs = [per_rank[r][i] for r in ranks]
        gbps = statistics.mean(r["bytes"] / (r["us"] * 1e-6) / 1e9 for r in rs)
        gbps_eager = statistics.mean(r["bytes"] / (r["eager_us"] * 1e-6) / 1e9 for r in rs)
        merged = {k: statistics.mean(r[k] for r in rs) for k in ("us", "recv", "eager_us", "eager_mean_us", "host_us")}
        graph = None if row["graph_us"] is None else statistics.mean(r["graph_us"] for r in rs)
        out.append({**row, **merged, "graph_us": graph, "gbps": gbps, "gbps_eager": gbps_eager})
    return out


def _best(rows: list[dict]) -> list[dict]:
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kernel"], r["mode"], r["dtype"], r["tokens"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return list(best.values())
