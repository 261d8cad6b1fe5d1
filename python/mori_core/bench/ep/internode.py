"""Benchmark of the inter-node kernel types (``python -m mori_core.bench ep --kernel-type ...``).

One process per rank (placed by :mod:`mori_core.placement`), ranks grouped into nodes of
``--gpu-per-node``. Every inter-node type runs on each network path of ``--net-paths``: ``auto``
(peer nodes whose NVSHMEM heap this GPU can address are written directly: all of them on one
NVLink machine) and ``put`` (``MORI_EP_INTERNODE_PATH=put``: staged NVSHMEM puts for every peer, as
over a NIC; on one machine NVSHMEM carries them over P2P, so this is a lower bound of what a
network path costs, not a NIC measurement). ``IntraNode`` in the kernel list runs the one-node
kernels on the same data as a reference.

Per (type, path, tokens, dtype): eager per-call latency (a CUDA event pair around each of
back-to-back calls, median; DeepEP's method), host time per call, optionally the CUDA-graph time,
and the kernels' own phase timestamps (``InterNodeEngine.phase_times``: where the device time of a
call goes: send, quiet + signal, launch gap, wait for the peers, forward / reduce). Bytes follow
MORI's convention: received rows (own included) x hidden x element size; network GB/s = total GB/s
x network rows / rows received (rows that cross the network, one per token and other node it
hits). Same-run baselines: NCCL ``all_to_all_single`` of the same rows (one rank per GPU) and, with
``--deepep-ll``, DeepEP's low-latency mode (:mod:`.deepep_ll`, its own processes, same data).
``--sweep`` adds a small sweep of the launch knobs (blocks, warps, rdma blocks, rows per put) at
the smallest token count for the LL types and the largest for InterNode / InterNodeV1.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from typing import Any, Callable, Optional

from mori_core.bench.ep.measure import (
    DTYPES, dtype_inputs, measure, merge_ranks, nccl_baseline, run_rank,
    time_eager, timing_columns_note, token_inputs
)
from mori_core.placement import Placement

INTER_TYPES = ("InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL")
# Phases of one call from the kernels' timestamps: name -> (from point, to point) (PHASE_POINTS names).
DISPATCH_PHASES = {
    "send": ("disp_send_start", "disp_send_copied"),
    "quiet+signal": ("disp_send_copied", "disp_send_signalled"),
    "launch gap": ("disp_send_signalled", "disp_recv_start"),
    "wait peers": ("disp_recv_start", "disp_recv_arrived"),
    "forward": ("disp_recv_arrived", "disp_recv_forwarded"),
    "node barrier": ("disp_recv_forwarded", "disp_recv_done"),
    "device total": ("disp_send_start", "disp_recv_done"),
}
COMBINE_PHASES = {
    "prep": ("comb_prep_start", "comb_prep_done"),
    "wait node": ("comb_send_start", "comb_send_ready"),
    "send": ("comb_send_ready", "comb_send_copied"),
    "quiet+signal": ("comb_send_copied", "comb_send_signalled"),
    "launch gap": ("comb_send_signalled", "comb_recv_start"),
    "wait peers": ("comb_recv_start", "comb_recv_arrived"),
    "reduce": ("comb_recv_arrived", "comb_recv_done"),
    "device total": ("comb_send_start", "comb_recv_done"),
}
# Launch grids of the sweep: (block_num, warp_per_block, rdma_block_num); rows per put on the put path.
SWEEP_GRIDS = [(32, 8, 0), (64, 8, 0), (128, 8, 0), (64, 16, 0), (128, 16, 0), (96, 8, 64)]
SWEEP_PUT_ROWS = (1, 2, 8, 32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The inter-node benchmark's own options (two flags)."""
    p.add_argument("--net-paths", default="auto",
                   help="inter-node types: network paths, comma separated: auto (direct where load/store-reachable), "
                        "put (every peer through NVSHMEM puts)")
    p.add_argument("--deepep-ll", action="store_true",
                   help="inter-node types: also time DeepEP's low-latency mode on the same data (same run; needs "
                        "deep_ep importable)")
    p.add_argument("--ll-tokens", default="",
                   help="inter-node types: token counts of the low-latency types (InterNodeV1LL, AsyncLL), a subset "
                        "of --tokens (default: all of them); their ops are sized for the largest")
    p.add_argument("--sweep-types", default=",".join(INTER_TYPES),
                   help="inter-node types: kernel types that --sweep sweeps")


LL_TYPES = ("InterNodeV1LL", "AsyncLL")


def kind_tokens(kind: str, args: argparse.Namespace) -> list[int]:
    """Token counts ``kind`` runs: ``--tokens``, or for the low-latency types the ``--ll-tokens``
    subset (ValueError naming a count that is not in ``--tokens``)."""
    tokens = [int(t) for t in args.tokens.split(",")]
    ll = [int(t) for t in getattr(args, "ll_tokens", "").split(",") if t.strip()]
    bad = [t for t in ll if t not in tokens]
    if bad:
        raise ValueError(f"--ll-tokens {bad} must be among --tokens {tokens}")
    return ll if ll and kind in LL_TYPES else tokens


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


def phase_reset(op: Any) -> None:
    """Clear the op's phase ring, so that the next :func:`phase_medians` sees only the calls made
    after this (no-op for kernel families without one)."""
    import torch

    engine = op._engine
    if hasattr(engine, "phase_times"):
        torch.cuda.synchronize()
        engine.phase_times()[0].zero_()


def phase_medians(op: Any, direction: int, phases: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Median microseconds of each phase over the rounds in the op's phase ring (the calls just
    timed). A round counts for a phase when both of its points were written in that round (rounds
    whose points are older than the ring are dropped by the sanity bounds)."""
    import torch

    engine = op._engine
    if not hasattr(engine, "phase_times"):
        return {}
    torch.cuda.synchronize()
    ring, names = engine.phase_times()
    t = ring[direction].cpu()
    col = {n: i for i, n in enumerate(names)}
    out = {}
    for phase, (a, b) in phases.items():
        x, y = t[:, col[a]], t[:, col[b]]
        d = [(int(v) - int(u)) / 1000.0 for u, v in zip(x.tolist(), y.tolist()) if u > 0 and v >= u and v - u < 10**9]
        if d:
            out[phase] = statistics.median(d)
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """Entry of one spawned rank: time every kernel type at every token count; puts ``(rank, rows, error)`` on ``results``."""
    run_rank(rank, world, port, results, functools.partial(_rank_rows, rank, world, args))


def _make_op(kind: str, rank: int, world: int, args: argparse.Namespace, max_type: int, path: str) -> Any:
    import torch

    from mori_core.ops import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp
    from mori_core.ops.internode import PATH_ENV

    tokens = kind_tokens(kind, args)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    gpn = args.gpu_per_node or world
    if kind in INTER_TYPES:
        os.environ[PATH_ENV] = path
    cfg = EpDispatchCombineConfig(
        data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=args.hidden,
        scale_dim=args.scale_dim if "fp8" in dtypes else 0, scale_type_size=4, max_token_type_size=max_type,
        max_num_inp_token_per_rank=max(tokens), num_experts_per_rank=args.experts // world,
        num_experts_per_token=args.topk, kernel_type=EpDispatchCombineKernelType[kind],
        gpu_per_node=gpn if kind != "IntraNode" else 8, use_external_inp_buf=False,
        rdma_block_num=max(args.rdma_block_num, 0),
    )
    return EpDispatchCombineOp(cfg)


def _rank_rows(rank: int, world: int, args: argparse.Namespace, dev: Any, sync: Callable[[], None]) -> list[dict]:
    """The rows of one rank (collective: every rank runs the same calls)."""
    import torch

    tokens = [int(t) for t in args.tokens.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    kinds = [k.strip() for k in args.kernel_type.split(",") if k.strip()]
    paths = [p.strip() for p in args.net_paths.split(",") if p.strip()]
    gpn = args.gpu_per_node or world
    max_type = max(torch.empty(0, dtype=getattr(torch, DTYPES[d])).element_size() for d in dtypes + ["bf16"])

    rows: list[dict] = []
    for kind in kinds:
        for path in paths if kind in INTER_TYPES else ["-"]:
            op = _make_op(kind, rank, world, args, max_type, path)
            label = f"{kind}" if path == "-" else f"{kind} [{path}]"
            net_paths = op._engine.network_paths if kind in INTER_TYPES else {}
            gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
            mine = kind_tokens(kind, args)
            for n in tokens:
                idx, x_bf16, w = token_inputs(n, args, gen, dev)  # drawn for every count: same data for all kinds
                if n not in mine:
                    continue
                net_rows = _network_rows(idx, op.config, gpn if kind != "IntraNode" else world)
                for dname in dtypes:
                    x, scales = dtype_inputs(x_bf16, dname, op.config.scale_dim, dev)
                    op.dispatch(x, w, scales, idx)
                    recv = int(op.get_dispatch_src_token_pos().numel())
                    fn = lambda: op.dispatch(x, w, scales, idx, block_num=args.dispatch_block_num,  # noqa: E731
                                             warp_per_block=args.dispatch_warp_per_block)
                    phase_reset(op)
                    row = measure(fn, args, sync, kernel=f"{label} dispatch", path=path, dtype=dname, tokens=n,
                                  recv=recv, net_rows=net_rows, bytes=recv * args.hidden * x.element_size(),
                                  net_paths=net_paths)
                    row["phases"] = phase_medians(op, 0, DISPATCH_PHASES)
                    rows.append(row)
                # combine (bf16, zero-copy), after a bf16 dispatch so the routing matches
                out, out_w, _, _, total = op.dispatch(x_bf16, w, None, idx)
                torch.cuda.synchronize()
                recv = int(total[0])
                reg = op.get_registered_combine_input_buffer(torch.bfloat16)
                reg[:recv].copy_(out[:recv])
                fn = lambda: op.combine(reg, out_w, idx, block_num=args.combine_block_num,  # noqa: E731
                                        warp_per_block=args.combine_warp_per_block, use_external_inp_buf=0)
                phase_reset(op)
                row = measure(fn, args, sync, kernel=f"{label} combine", path=path, dtype="bf16", tokens=n, recv=recv,
                              net_rows=net_rows, bytes=recv * args.hidden * 2, net_paths=net_paths)
                row["phases"] = phase_medians(op, 1, COMBINE_PHASES)
                rows.append(row)
                op.check_error()
                sweep_types = [t.strip() for t in getattr(args, "sweep_types", ",".join(INTER_TYPES)).split(",")]
                if args.sweep and kind in INTER_TYPES and kind in sweep_types and n == _sweep_tokens(kind, mine):
                    rows += _sweep(op, label, path, n, x_bf16, w, idx, dtypes, args, sync, dev)
            sync()
            op.close()
    if not args.no_nccl:
        gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
        for n in tokens:
            idx, x_bf16, w = token_inputs(n, args, gen, dev)
            cfg = argparse.Namespace(world_size=world, num_experts_per_rank=args.experts // world)
            for r in nccl_baseline(idx, n, x_bf16, cfg, args, sync, dev):
                rows.append({**r, "net_rows": 0, "path": "-", "phases": {}})
    return rows


def _sweep_tokens(kind: str, tokens: list[int]) -> int:
    """Token count the sweep runs at: the smallest for the low-latency types, the largest for
    InterNode / InterNodeV1 (throughput types)."""
    return min(tokens) if kind in ("InterNodeV1LL", "AsyncLL") else max(tokens)


def _sweep(op: Any, label: str, path: str, n: int, x_bf16: Any, w: Any, idx: Any, dtypes: list[str],
           args: argparse.Namespace, sync: Callable[[], None], dev: Any) -> list[dict]:
    """Eager latency of dispatch (first dtype) and combine over SWEEP_GRIDS, and over SWEEP_PUT_ROWS
    on the put path; rows marked ``sweep``."""
    import torch

    eager = argparse.Namespace(**{**vars(args), "no_graph": True, "eager_calls": min(args.eager_calls, 20)})
    dname = dtypes[0]
    x, scales = dtype_inputs(x_bf16, dname, op.config.scale_dim, dev)
    out, out_w, _, _, total = op.dispatch(x_bf16, w, None, idx)
    torch.cuda.synchronize()
    recv = int(total[0])
    reg = op.get_registered_combine_input_buffer(torch.bfloat16)
    reg[:recv].copy_(out[:recv])
    handle = op._engine.handle
    default_rows = handle.put_rows
    knobs = [(b, wp, r, default_rows) for b, wp, r in SWEEP_GRIDS]
    if op._engine.network_paths.get("put"):
        knobs += [(96, 8, 0, pr) for pr in SWEEP_PUT_ROWS if pr != default_rows and pr <= n]
    rows = []
    for blocks, warps, rdma, put_rows in knobs:
        handle.put_rows = put_rows
        d = functools.partial(op.dispatch, x, w, scales, idx, block_num=blocks, rdma_block_num=rdma if rdma else -1,
                              warp_per_block=warps)
        phase_reset(op)
        d_us, _, d_host = time_eager(d, eager, sync)
        d_ph = phase_medians(op, 0, DISPATCH_PHASES)
        op.dispatch(x_bf16, w, None, idx, block_num=blocks, rdma_block_num=rdma if rdma else -1, warp_per_block=warps)
        c = functools.partial(op.combine, reg, out_w, idx, block_num=blocks, warp_per_block=warps,
                              use_external_inp_buf=0)
        phase_reset(op)
        c_us, _, _ = time_eager(c, eager, sync)
        c_ph = phase_medians(op, 1, COMBINE_PHASES)
        rows.append(dict(sweep=True, kernel=label, path=path, dtype=dname, tokens=n, blocks=blocks, warps=warps,
                         rdma=rdma, put_rows=put_rows, dispatch_us=d_us, combine_us=c_us, host_us=d_host,
                         dispatch_send_us=d_ph.get("send"), dispatch_forward_us=d_ph.get("forward"),
                         combine_send_us=c_ph.get("send"), combine_reduce_us=c_ph.get("reduce")))
    handle.put_rows = default_rows
    op.check_error()
    return rows


def _merge_sweep(per_rank: dict[int, list[dict]]) -> tuple[list[dict], list[dict]]:
    """(timing rows merged over ranks, sweep rows merged over ranks)."""
    ranks = sorted(per_rank)
    timing = {r: [x for x in per_rank[r] if not x.get("sweep")] for r in ranks}
    sweep = {r: [x for x in per_rank[r] if x.get("sweep")] for r in ranks}
    merged = merge_ranks(timing)
    for i, m in enumerate(merged):  # phases: mean over ranks of each rank's median
        ph = [timing[r][i].get("phases") or {} for r in ranks]
        m["phases"] = {k: statistics.mean(p[k] for p in ph if k in p) for k in ph[0]}
    sw = []
    for i, row in enumerate(sweep[ranks[0]]):
        rs = [sweep[r][i] for r in ranks]
        out = dict(row)
        for k in ("dispatch_us", "combine_us", "host_us", "dispatch_send_us", "dispatch_forward_us", "combine_send_us",
                  "combine_reduce_us"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            out[k] = statistics.mean(vals) if vals else None
        sw.append(out)
    return merged, sw


def _fmt(v: Optional[float]) -> Any:
    return "-" if v is None else round(v, 1)


def report(per_rank: dict[int, list[dict]], args: argparse.Namespace, world: int, where: Placement) -> int:
    """Print the tables of the gathered rows (MORI's byte convention), the DeepEP low-latency
    baseline beside ours (``--deepep-ll``), the phase breakdown and the sweep."""
    import json

    import torch

    from mori_core.bench.table import print_table

    merged, sweep = _merge_sweep(per_rank)
    deepep = []
    if getattr(args, "deepep_ll", False) and not where.shared:
        from mori_core.bench.ep import deepep_ll

        deepep = deepep_ll.run_baseline(args, world)
    gpn = args.gpu_per_node or world
    title = (f"EP{world} ({world // gpn} node(s) x {gpn} GPU) on {torch.cuda.get_device_name(0)}: hidden "
             f"{args.hidden}, top-{args.topk} of {args.experts}, uniform routing; NVSHMEM transport: "
             f"{os.environ.get('NVSHMEM_REMOTE_TRANSPORT', 'default')}"
             f"{' (P2P off)' if os.environ.get('NVSHMEM_DISABLE_P2P') == '1' else ''}")
    headers = ["kernel", "dtype", "tokens", "recv/rank", "net rows", "eager us (median)", "DeepEP timer us",
               "host us/call", "graph us", "total GB/s", "NVLink GB/s", "network GB/s"]
    if where.shared:  # latency and bandwidth mean nothing when ranks share a GPU
        title += f"; {where.describe()}"
        headers = headers[:5] + ["host us/call"]
    table = []
    for m in merged + deepep:
        frac = m.get("net_rows", 0) / m["recv"] if m.get("recv") else 0.0
        row = [m["kernel"], m["dtype"], m["tokens"], round(m["recv"]), round(m.get("net_rows", 0))]
        if where.shared:
            table.append(row + [m["host_us"]])
        else:
            table.append(row + [m["eager_us"], _fmt(m.get("kernel_us")), m["host_us"], _fmt(m.get("graph_us")),
                                m["gbps"], m["gbps"] * (1 - frac), m["gbps"] * frac])
    print_table(title, headers, table,
                note=timing_columns_note(where) or (
                    "GB/s from the graph time when timed, else eager = received rows (incl. own) x hidden x element "
                    "size / time, mean over ranks; network GB/s = total x network rows / rows received (rows that "
                    "cross the network, node-deduplicated). [auto]: direct stores where the peer's NVSHMEM heap is "
                    "load/store-reachable; [put]: every peer through staged NVSHMEM puts (over P2P here: a lower "
                    "bound of a network path). DeepEP timer: its tests' kineto kernel time (DeepEP rows only)."))
    if deepep and not where.shared:
        _print_side_by_side(merged, deepep, print_table)
    phase_rows = [m for m in merged if m.get("phases")]
    if phase_rows and not where.shared:
        names = list(DISPATCH_PHASES) + [k for k in COMBINE_PHASES if k not in DISPATCH_PHASES]
        print_table(
            "Where the device time goes (kernel timestamps, median per call, mean over ranks; us)",
            ["kernel", "dtype", "tokens", "eager us"] + names,
            [[m["kernel"], m["dtype"], m["tokens"], m["eager_us"]] + [_fmt(m["phases"].get(k)) for k in names]
             for m in phase_rows],
            note="send: first block start to last block done (rows written / puts issued); quiet+signal: puts "
                 "completed and peers signalled; launch gap: between the send and receive launches; wait peers: "
                 "receive launch start to every peer's signal; forward/reduce: the receive launch's work; device "
                 "total: first kernel start to last kernel end (eager minus device total = launch and event "
                 "overheads)")
    if sweep and not where.shared:
        print_table(
            "Launch-knob sweep (eager us, mean over ranks)",
            ["kernel", "dtype", "tokens", "blocks", "warps", "rdma", "put rows", "dispatch us", "combine us",
             "host us", "disp send", "disp fwd", "comb send", "comb reduce"],
            [[s["kernel"], s["dtype"], s["tokens"], s["blocks"], s["warps"], s["rdma"], s["put_rows"],
              _fmt(s["dispatch_us"]), _fmt(s["combine_us"]), _fmt(s["host_us"]), _fmt(s["dispatch_send_us"]),
              _fmt(s["dispatch_forward_us"]), _fmt(s["combine_send_us"]), _fmt(s["combine_reduce_us"])]
             for s in sweep])
    if not where.shared:
        _print_vs_intranode(merged, print_table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "gpu_per_node": gpn, "gpus": where.num_gpus,
                       "ranks_per_gpu": where.ranks_per_gpu, "args": vars(args), "rows": merged, "deepep_ll": deepep,
                       "sweep": sweep}, f, indent=1)
    return 0


def _print_side_by_side(ours: list[dict], deepep: list[dict], print_table: Callable[..., None]) -> None:
    """Each of our low-latency (V1LL, AsyncLL) and IntraNode rows next to DeepEP's low-latency row of
    the same (op, dtype, tokens); InterNode/InterNodeV1 at those sizes are in the main table."""
    ref = {(d["kernel"].split()[-1], d["dtype"], d["tokens"]): d for d in deepep}
    rows = []
    for m in ours:
        parts = m["kernel"].split()
        d = ref.get((parts[-1], m["dtype"], m["tokens"]))
        if d is None or parts[0] not in LL_TYPES + ("IntraNode",):
            continue
        rows.append([m["kernel"], m["dtype"], m["tokens"], m["eager_us"], d["eager_us"], _fmt(d.get("kernel_us")),
                     round(m["eager_us"] / d["eager_us"], 2), m["host_us"], d["host_us"]])
    if rows:
        print_table("Side by side: ours vs DeepEP low-latency mode (same run, same routing and tokens; eager us)",
                    ["ours", "dtype", "tokens", "ours us", "DeepEP us", "DeepEP kernel us", "ours/DeepEP",
                     "ours host us", "DeepEP host us"], rows,
                    note="DeepEP kernel us: its tests' timer (bench_kineto: profiler, second of two periods, ranks "
                         "aligned by a matmul and an all-reduce). Both sized for the largest token count here.")


def _print_vs_intranode(merged: list[dict], print_table: Callable[..., None]) -> None:
    """Each InterNode / InterNodeV1 row next to our IntraNode row of the same (op, dtype, tokens): the issue's
    throughput target is inter-node bandwidth >= 0.8x IntraNode's (= IntraNode us / ours us)."""
    ref = {(m["kernel"].split()[-1], m["dtype"], m["tokens"]): m for m in merged
           if m["kernel"].startswith("IntraNode ")}
    rows = []
    for m in merged:
        kind = m["kernel"].split()[0]
        if kind not in ("InterNode", "InterNodeV1"):
            continue
        r = ref.get((m["kernel"].split()[-1], m["dtype"], m["tokens"]))
        if r is not None:
            rows.append([m["kernel"], m["dtype"], m["tokens"], m["eager_us"], r["eager_us"],
                         round(r["eager_us"] / m["eager_us"], 2), m["host_us"]])
    if rows:
        print_table("Ours inter-node vs our IntraNode (same run, same data; bandwidth ratio = IntraNode us / ours us)",
                    ["inter-node kernel", "dtype", "tokens", "eager us", "IntraNode eager us", "bandwidth ratio",
                     "host us"], rows)
