"""MORI-EP dispatch/combine benchmark (mirrors MORI's bench_dispatch_combine).

``python -m mori_core.bench ep [--world-size 4] [--tokens 128,512,4096] [--dtypes bf16,fp8]``

Spawns one process per GPU (NCCL group + shmem), builds uniform random top-k routing
(distinct experts per token, uniform over all experts), and times each kernel as CUDA-graph
replays of ``--ops-per-graph`` back-to-back launches (median over ``--iters`` replays, per op).
Bandwidth counts what a rank receives, MORI/DeepEP style: received tokens (including its own)
x hidden x element size (scales excluded), per rank, averaged over ranks. The NCCL baseline
moves the same rows with ``all_to_all_single`` (uneven splits from the same routing) in the
same run. ``--sweep`` times a grid of (block_num, warp_per_block) per kernel and token count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback
from typing import Any, Optional

from mori_core.bench import ep_extensions

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
    p.add_argument("--iters", type=int, default=20, help="graph replays per measurement")
    p.add_argument("--ops-per-graph", type=int, default=10, help="back-to-back launches per captured graph")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of graph replays")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL all_to_all_single baseline")
    p.add_argument("--sweep", action="store_true", help="sweep (block_num, warp_per_block) per kernel")
    p.add_argument("--json", default="", help="write all measurements to this file")
    p.add_argument("--seed", type=int, default=1)
    ep_extensions.add_arguments(p)


# ----------------------------------------------------------------------------- per-rank work
def _routing(n: int, experts: int, topk: int, gen: Any, device: Any) -> Any:
    import torch

    scores = torch.rand(n, experts, generator=gen, device="cpu")
    return scores.topk(topk, dim=1).indices.to(torch.int32).to(device)


def _time_graph(fn: Any, args: argparse.Namespace, sync: Any) -> float:
    """Median microseconds per op of ``fn`` (one launch), captured ``ops_per_graph`` times."""
    import torch

    k = args.ops_per_graph
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    if args.no_graph:
        times = []
        for _ in range(args.iters):
            sync()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(k):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / k)
        return statistics.median(times)
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
                launches = [(args.dispatch_block_num, args.dispatch_warp_per_block)]
                if args.sweep:
                    launches = [(b, wp) for b in SWEEP_BLOCKS for wp in SWEEP_WARPS]
                res = op.dispatch(x, w, scales, idx)
                torch.cuda.synchronize()
                recv = int(res[4][0])
                for bn, wpb in launches:
                    us = _time_graph(
                        lambda: op.dispatch(x, w, scales, idx, block_num=bn, warp_per_block=wpb), args, sync
                    )
                    p = op._cached_dispatch_launch
                    rows.append(
                        dict(kernel="dispatch", dtype=dname, tokens=n, recv=recv, us=us, bytes=recv * args.hidden * x.element_size(),
                             blocks=p.block_num, warps=p.warp_per_block, mode="-")
                    )
            # combine (bf16), after a bf16 dispatch so the routing state matches
            out, out_w, _, _, total = op.dispatch(x_bf16, w, None, idx)
            torch.cuda.synchronize()
            recv = int(total[0])
            y = out[: max(recv, 1)].clone()
            reg = op.get_registered_combine_input_buffer(torch.bfloat16)
            reg[:recv].copy_(out[:recv])
            for push in modes:
                launches = [(args.combine_block_num, args.combine_warp_per_block)]
                if args.sweep:
                    launches = [(b, wp) for b in SWEEP_BLOCKS for wp in SWEEP_WARPS if wp <= 16]
                for bn, wpb in launches:
                    inp = y if push else reg
                    us = _time_graph(
                        lambda: op.combine(inp, out_w, idx, block_num=bn, warp_per_block=wpb, use_external_inp_buf=int(push)),
                        args,
                        sync,
                    )
                    p = op._cached_combine_launch
                    rows.append(
                        dict(kernel="combine", dtype="bf16", tokens=n, recv=recv, us=us, bytes=recv * args.hidden * 2,
                             blocks=p.block_num, warps=p.warp_per_block, mode="push" if push else "pull")
                    )
            op.check_error()
            rows.extend(ep_extensions.extension_rows(op, cfg, args, n, x_bf16, w, idx, _time_graph, sync))
            if not args.no_nccl:
                rows.extend(_nccl_baseline(idx, n, x_bf16, cfg, args, sync, dev))
        sync()
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
    # Eager launches (NCCL inside CUDA graphs is not relied on); back-to-back ops amortise launch cost.
    eager = argparse.Namespace(**{**vars(args), "no_graph": True})
    for name, fn in (("nccl a2a (dispatch)", fwd), ("nccl a2a (combine)", back)):
        us = _time_graph(fn, eager, sync)
        out.append(dict(kernel=name, dtype="bf16", tokens=n, recv=sum(rc), us=us, bytes=nbytes, blocks=0, warps=0, mode="-"))
    return out


# ----------------------------------------------------------------------------- driver
def run(args: argparse.Namespace) -> int:
    """Spawn the ranks, gather per-rank rows, print the tables."""
    import torch
    import torch.multiprocessing as mp

    from mori_core.bench.table import print_table

    if args.auto:
        os.environ["MORI_EP_LAUNCH_CONFIG_MODE"] = "AUTO"
    world = args.world_size or torch.cuda.device_count()
    if world < 1:
        print("ep benchmark: no GPU visible")
        return 2
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, q)) for r in range(world)]
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
        return 1
    merged = _merge(per_rank)
    name = torch.cuda.get_device_name(0)
    title = (
        f"EP{world} on {world}x {name}: hidden {args.hidden}, top-{args.topk} of {args.experts}, uniform routing, "
        f"{'graph replay' if not args.no_graph else 'eager'} x{args.ops_per_graph}, median of {args.iters}"
    )
    headers = ["kernel", "mode", "dtype", "tokens", "recv/rank", "blocks x warps", "latency us", "GB/s"]
    table_rows = [
        [m["kernel"], m["mode"], m["dtype"], m["tokens"], round(m["recv"]), f"{m['blocks']}x{m['warps']}" if m["blocks"] else "-",
         m["us"], m["gbps"]]
        for m in merged
    ]
    if args.sweep:
        best = _best(merged)
        print_table(title + " (sweep, all)", headers, table_rows)
        print_table(title + " (sweep, best per kernel)", headers, [
            [m["kernel"], m["mode"], m["dtype"], m["tokens"], round(m["recv"]), f"{m['blocks']}x{m['warps']}", m["us"], m["gbps"]]
            for m in best
        ])
    else:
        print_table(title, headers, table_rows, note="GB/s = received tokens (incl. local) x hidden x element size / time, mean over ranks")
    ep_extensions.print_extension_tables(per_rank, f"EP{world} on {world}x {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "device": name, "args": vars(args), "rows": merged, "per_rank": per_rank}, f, indent=1)
    return 0


def _merge(per_rank: dict[int, list[dict]]) -> list[dict]:
    ranks = sorted(per_rank)
    out = []
    for i, row in enumerate(per_rank[ranks[0]]):
        rs = [per_rank[r][i] for r in ranks]
        gbps = statistics.mean(r["bytes"] / (r["us"] * 1e-6) / 1e9 for r in rs)
        out.append({**row, "us": statistics.mean(r["us"] for r in rs), "recv": statistics.mean(r["recv"] for r in rs), "gbps": gbps})
    return out


def _best(rows: list[dict]) -> list[dict]:
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kernel"], r["mode"], r["dtype"], r["tokens"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return list(best.values())
