"""Benchmark of the inter-node kernel types (``python -m mori_core.bench ep --kernel-type ...``).

One process per rank (placed by :mod:`mori_core.placement`), ranks grouped into nodes of
``--gpu-per-node``. Each kernel type is
timed per op: as CUDA-graph replays of ``--ops-per-graph`` back-to-back launches, and eagerly
with a CUDA event pair around back-to-back calls (medians). The host time per eager call is
measured too. Bytes follow MORI's convention: received tokens (own included) x hidden x
element size. The network share is split out as MORI does: network GB/s = total GB/s x
(network rows / rows received), where network rows are the rows that physically cross the
network (one per token and other node it hits: node-deduplicated). NCCL ``all_to_all_single`` of the same rows
is timed in the same run as a baseline (one rank per GPU only; with ranks sharing a GPU the
table shows host time only).
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Callable

from mori_core.bench.ep.measure import (
    DTYPES, dtype_inputs, measure, merge_ranks, nccl_baseline, run_rank,
    timing_columns_note, token_inputs
)
from mori_core.placement import Placement


def _network_rows(idx: Any, cfg: Any, gpn: int) -> int:
    """Rows this rank sends over the network: one per (token, other node it hits). With the
    symmetric uniform routing of the benchmark the mean over ranks equals the rows received."""
    import torch

    dest = idx.to(torch.int64) // cfg.num_experts_per_rank
    nodes = cfg.world_size // gpn
    hit = torch.zeros(idx.shape[0], nodes + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, torch.where((idx >= 0) & (idx < cfg.num_experts), dest // gpn, nodes), True)
    hit[:, cfg.rank // gpn] = False
    return int(hit[:, :nodes].sum())


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """Entry of one spawned rank: time every kernel type at every token count; puts ``(rank, rows, error)`` on ``results``."""
    run_rank(rank, world, port, results, functools.partial(_rank_rows, rank, world, args))


def _rank_rows(rank: int, world: int, args: argparse.Namespace, dev: Any, sync: Callable[[], None]) -> list[dict]:
    """The rows of one rank (collective: every rank runs the same calls)."""
    import torch

    from mori_core.ops import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp

    tokens = [int(t) for t in args.tokens.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    kinds = [k.strip() for k in args.kernel_type.split(",") if k.strip()]
    gpn = args.gpu_per_node or world
    max_type = max(torch.empty(0, dtype=getattr(torch, DTYPES[d])).element_size() for d in dtypes + ["bf16"])

    rows: list[dict] = []
    for kind in kinds:
        cfg = EpDispatchCombineConfig(
            data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=args.hidden,
            scale_dim=args.scale_dim if "fp8" in dtypes else 0, scale_type_size=4, max_token_type_size=max_type,
            max_num_inp_token_per_rank=max(tokens), num_experts_per_rank=args.experts // world,
            num_experts_per_token=args.topk, kernel_type=EpDispatchCombineKernelType[kind],
            gpu_per_node=gpn if kind != "IntraNode" else 8, use_external_inp_buf=False,
            rdma_block_num=max(args.rdma_block_num, 0),
        )
        op = EpDispatchCombineOp(cfg)
        gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
        for n in tokens:
            idx, x_bf16, w = token_inputs(n, args, gen, dev)
            for dname in dtypes:
                x, scales = dtype_inputs(x_bf16, dname, cfg.scale_dim, dev)
                op.dispatch(x, w, scales, idx)
                recv = int(op.get_dispatch_src_token_pos().numel())
                net_rows = _network_rows(idx, cfg, gpn if kind != "IntraNode" else world)
                fn = lambda: op.dispatch(x, w, scales, idx, block_num=args.dispatch_block_num,
                                         warp_per_block=args.dispatch_warp_per_block)
                rows.append(measure(fn, args, sync, kernel=f"{kind} dispatch", dtype=dname, tokens=n,
                                     recv=recv, net_rows=net_rows, bytes=recv * args.hidden * x.element_size()))
            # combine (bf16, zero-copy), after a bf16 dispatch so the routing matches
            out, out_w, _, _, total = op.dispatch(x_bf16, w, None, idx)
            torch.cuda.synchronize()
            recv = int(total[0])
            op.get_registered_combine_input_buffer(torch.bfloat16)[:recv].copy_(out[:recv])
            reg = op.get_registered_combine_input_buffer(torch.bfloat16)
            fn = lambda: op.combine(reg, out_w, idx, block_num=args.combine_block_num,
                                    warp_per_block=args.combine_warp_per_block, use_external_inp_buf=0)
            rows.append(measure(fn, args, sync, kernel=f"{kind} combine", dtype="bf16", tokens=n, recv=recv,
                                 net_rows=net_rows, bytes=recv * args.hidden * 2))
            op.check_error()
            if not args.no_nccl and kind == kinds[-1]:
                for r in nccl_baseline(idx, n, x_bf16, cfg, args, sync, dev):
                    rows.append({**r, "net_rows": 0})
        sync()
        op.close()
    return rows


def report(per_rank: dict[int, list[dict]], args: argparse.Namespace, world: int, where: Placement) -> int:
    """Print one table of the gathered rows (MORI's byte convention)."""
    import json

    import torch

    from mori_core.bench.table import print_table

    merged = merge_ranks(per_rank)
    gpn = args.gpu_per_node or world
    title = (f"EP{world} ({world // gpn} node(s) x {gpn} GPU) on {torch.cuda.get_device_name(0)}: hidden "
             f"{args.hidden}, top-{args.topk} of {args.experts}, uniform routing; network transport: "
             f"{os.environ.get('NVSHMEM_REMOTE_TRANSPORT', 'NVSHMEM default')}"
             f"{' (P2P off)' if os.environ.get('NVSHMEM_DISABLE_P2P') == '1' else ''}")
    headers = ["kernel", "dtype", "tokens", "recv/rank", "net rows", "eager us (median)", "host us/call", "graph us",
               "total GB/s", "NVLink GB/s", "network GB/s"]
    if where.shared:  # latency and bandwidth mean nothing when ranks share a GPU
        title += f"; {where.describe()}"
        headers = headers[:5] + ["host us/call"]
    table = []
    for m in merged:
        frac = m["net_rows"] / m["recv"] if m.get("recv") else 0.0
        graph = m["graph_us"] if m["graph_us"] is not None else "-"
        row = [m["kernel"], m["dtype"], m["tokens"], round(m["recv"]), round(m.get("net_rows", 0))]
        if where.shared:
            table.append(row + [m["host_us"]])
        else:
            table.append(row + [m["eager_us"], m["host_us"], graph, m["gbps"], m["gbps"] * (1 - frac), m["gbps"] * frac])
    print_table(title, headers, table,
                note=timing_columns_note(where) or (
                    "GB/s from the graph time (eager for NCCL) = received rows (incl. own) x hidden x element size / "
                    "time, mean over ranks; "
                    "network GB/s = total x network rows / rows received (MORI's RDMA BW; network rows are "
                    "node-deduplicated, i.e. what crosses the NIC)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "gpu_per_node": gpn, "gpus": where.num_gpus, "ranks_per_gpu": where.ranks_per_gpu,
                       "args": vars(args), "rows": merged}, f, indent=1)
    return 0
