"""``python -m mori_core.bench ccl``: MORI-CCL next to NCCL (torch.distributed) and torch's
symmetric-memory all-reduce, measured in the same run, one rank per GPU.

Tables (latencies are the slowest rank's median of back-to-back eager calls, each timed with a
CUDA event pair; host time is the median wall time of the call itself; bus bandwidth uses NCCL's
definitions: all-reduce 2(n-1)/n*S/t, all-gather (n-1)*S/t, all-to-all (n-1)/n*S/t for S bytes
of input per rank):

* latency / bandwidth per size (8 KiB ... 256 MiB per rank) for every engine of ours
  (auto, ce = copy engines, sm = kernels) and the baselines, plus CUDA-graph time per call for
  small all-reduces;
* the overlap row: a bf16 GEMM alone, and beside back-to-back 64 MiB all-gathers (ours on copy
  engines, ours on SMs, NCCL): the GEMM's throughput kept;
* link ceilings (``--ceilings``): a local copy and peer pulls/pushes with cudaMemcpyAsync,
  with 1, 2 or 4 copies in flight per peer, and SM probe kernels that only move bytes, in the
  EP kernels' patterns (16-byte pushes, TMA bulk pushes on sm_90, 16-byte pulls);
* the tuning sweep (``--sweep``): the copy engines' streams per peer (``ce_split``), SM grids, and
  one-shot vs two-shot for small all-reduces inside CUDA graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable, Optional

from mori_core.bench.table import fmt_bytes, print_table

COLLECTIVES = ("allreduce", "allgather", "all2all")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MIB = 1 << 20


def _sizes(text: str) -> list[int]:
    from mori_core.ccl.options import parse_bytes

    return [parse_bytes(s, "--sizes") for s in text.split(",") if s.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the CCL benchmark."""
    p.add_argument("--world-size", type=int, default=0, help="ranks, one per GPU (default: min(4, GPUs))")
    p.add_argument("--sizes", default="8K,64K,256K,1M,4M,16M,64M,256M", help="input bytes per rank")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--engines", default="auto,ce,sm", help="our engines to time (auto, ce, sm)")
    p.add_argument("--iters", type=int, default=0, help="timed calls per point (0: by size)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-baselines", action="store_true", help="skip NCCL and torch symmetric memory")
    p.add_argument("--no-overlap", action="store_true", help="skip the GEMM overlap row")
    p.add_argument("--overlap-bytes", default="64M", help="all-gather input bytes per rank beside the GEMM")
    p.add_argument("--gemm", type=int, default=8192, help="M=N=K of the bf16 GEMM")
    p.add_argument("--ceilings", action="store_true", help="link ceilings (copy engines; SM probe kernels)")
    p.add_argument("--sweep", action="store_true", help="ce_split / SM grid / one- vs two-shot sweep")
    p.add_argument("--json", default="", help="write every row to this JSON file")


def run(args: argparse.Namespace) -> int:
    import torch

    from mori_core.bench.ep.measure import spawn_ranks

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.world_size or min(4, gpus)
    if world < 2 or gpus < world:
        print(f"ccl benchmark: needs >= 2 GPUs, one rank per GPU ({gpus} visible, world {world})")
        return 2
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "8G")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    args.sizes_list = _sizes(args.sizes)
    args.overlap_nbytes = _sizes(args.overlap_bytes)[0]
    t0 = time.time()
    per_rank = spawn_ranks(_rank_main, world, args)
    if per_rank is None:
        return 1
    rows = _merge(per_rank)
    _print(rows, world, args, torch.cuda.get_device_name(0))
    print(f"\n(ccl benchmark: {world} ranks, {time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


# ----------------------------------------------------------------------------- in a rank
def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    from mori_core.bench.ep.measure import run_rank

    stacks_after = float(os.environ.get("MORI_BENCH_STACKS_AFTER_S", "0"))
    if stacks_after > 0:  # a hang under a wall-clock limit: every thread's stack once, then go on
        import faulthandler

        faulthandler.dump_traceback_later(stacks_after, repeat=False)

    run_rank(rank, world, port, q, lambda dev, sync: _measure_rank(rank, world, dev, sync, args))


def _cpu_barrier() -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))  # over gloo: no GPU stream involved


def _iters(args: argparse.Namespace, nbytes: int) -> int:
    if args.iters:
        return args.iters
    return 40 if nbytes <= 4 * MIB else 15 if nbytes <= 64 * MIB else 8


def _eager(fn: Callable[[], Any], calls: int, warmup: int) -> tuple[float, float]:
    """(median GPU us, median host us) of ``calls`` back-to-back calls, an event pair around each."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    _cpu_barrier()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    host = []
    for i in range(calls):
        starts[i].record()
        t0 = time.perf_counter_ns()
        fn()
        host.append(time.perf_counter_ns() - t0)
        ends[i].record()
    torch.cuda.synchronize()
    us = [s.elapsed_time(e) * 1000 for s, e in zip(starts, ends)]
    return statistics.median(us), statistics.median(host) / 1000


def _graph(fn: Callable[[], Any], per_graph: int = 10, replays: int = 10) -> float:
    """Median GPU us per call of ``fn`` captured ``per_graph`` times into one CUDA graph."""
    import torch

    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    _cpu_barrier()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(per_graph):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        _cpu_barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / per_graph)
    del g
    return statistics.median(times)


def _ours(kind: str, rank: int, world: int, in_bytes: int, dtype: Any, **opts: Any) -> Any:
    from mori_core.ccl import All2allSdma, AllgatherSdma, AllreduceSdma
    from mori_core.ccl.options import CclOptions

    o = CclOptions.resolve(**opts)
    if kind == "allreduce":
        return AllreduceSdma(rank, world, input_buffer_size=in_bytes, output_buffer_size=in_bytes, dtype=dtype,
                             options=o)
    if kind == "allgather":
        return AllgatherSdma(rank, world, input_buffer_size=in_bytes, output_buffer_size=in_bytes * world, options=o)
    return All2allSdma(rank, world, input_buffer_size=in_bytes, output_buffer_size=in_bytes, options=o)


def _call(kind: str, op: Any, x: Any, out: Any, nbytes: int, esize: int, world: int) -> Callable[[], Any]:
    count = nbytes // esize if kind != "all2all" else nbytes // esize // world
    return lambda: op(x, out, count)


def _nccl(kind: str, x: Any, out: Any, nbytes: int, esize: int, world: int) -> Callable[[], Any]:
    import torch.distributed as dist

    n = nbytes // esize
    xi = x[:n]
    if kind == "allreduce":
        return lambda: dist.all_reduce(xi)
    if kind == "allgather":
        o = out[: n * world]
        return lambda: dist.all_gather_into_tensor(o, xi)
    o = out[:n]
    return lambda: dist.all_to_all_single(o, xi)


def _symm(rank: int, dev: Any, dtype: Any, max_bytes: int) -> Optional[tuple[Any, str]]:
    """A symmetric-memory tensor of torch (rendezvous over the world group), or None."""
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(group_name)
            except Exception:
                pass
        t = symm_mem.empty(max_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=dev)
        symm_mem.rendezvous(t, group_name)
        return t, group_name
    except Exception as e:  # reported in the table as n/a
        if rank == 0:
            print(f"torch symmetric memory unavailable: {type(e).__name__}: {e}", flush=True)
        return None


def _measure_rank(rank: int, world: int, dev: Any, sync: Callable[[], None], args: argparse.Namespace) -> list[dict]:
    import torch

    dtype = getattr(torch, DTYPES[args.dtype])
    esize = torch.empty((), dtype=dtype).element_size()
    rows: list[dict] = []
    sizes = args.sizes_list
    max_bytes = max(sizes)
    engines = [e for e in args.engines.split(",") if e]
    for kind in [k for k in args.collectives.split(",") if k]:
        if rank == 0:
            print(f"ccl bench: {kind} ({time.strftime('%X')})", flush=True)
        x = torch.randn(max_bytes // esize, device=dev).to(dtype)
        out = torch.empty(max_bytes // esize * (world if kind == "allgather" else 1), dtype=dtype, device=dev)
        ops = {e: _ours(kind, rank, world, max_bytes, dtype, engine=e) for e in engines}
        symm = _symm(rank, dev, dtype, max_bytes) if kind == "allreduce" and not args.no_baselines else None
        for nbytes in sizes:
            calls = _iters(args, nbytes)
            impls: list[tuple[str, Callable[[], Any], str]] = []
            for e, op in ops.items():
                impls.append((f"ours {e}", _call(kind, op, x, out, nbytes, esize, world), op.engine_for(
                    nbytes if kind != "all2all" else nbytes // world)))
            if not args.no_baselines:
                impls.append(("nccl", _nccl(kind, x, out, nbytes, esize, world), "nccl"))
                if symm is not None:
                    t, gname = symm
                    n = nbytes // esize
                    view = t[:n]
                    if nbytes <= 16 * MIB:
                        impls.append(("torch symm 1-shot",
                                      lambda v=view, g=gname: torch.ops.symm_mem.one_shot_all_reduce(v, "sum", g), "symm"))
                    impls.append(("torch symm 2-shot",
                                  lambda v=view, g=gname: torch.ops.symm_mem.two_shot_all_reduce_(v, "sum", g), "symm"))
            for name, fn, path in impls:
                row = dict(table="latency", kind=kind, bytes=nbytes, impl=name, path=path)
                try:
                    us, host = _eager(fn, calls, args.warmup)
                    row.update(us=us, host_us=host)
                except Exception as e:
                    row.update(error=f"{type(e).__name__}: {str(e)[:120]}")
                    torch.cuda.synchronize()
                if "us" in row and kind == "allreduce" and nbytes <= MIB and name in (
                        "ours auto", "nccl", "torch symm 1-shot", "torch symm 2-shot"):
                    try:
                        row["graph_us"] = _graph(fn)
                    except Exception as e:
                        row.update(error=f"graph: {type(e).__name__}: {str(e)[:100]}")
                        torch.cuda.synchronize()
                rows.append(row)
        for op in ops.values():
            op.check_error()
            op.close()
        del x, out, symm
        torch.cuda.empty_cache()
        sync()
    if not args.no_overlap:
        if rank == 0:
            print(f"ccl bench: overlap ({time.strftime('%X')})", flush=True)
        rows += _overlap(rank, world, dev, args)
    if args.ceilings:
        rows += _ceilings(rank, world, dev)
    if args.sweep:
        if rank == 0:
            print(f"ccl bench: sweep ({time.strftime('%X')})", flush=True)
        rows += _sweep(rank, world, dev, dtype, esize, args)
    return rows


def _overlap(rank: int, world: int, dev: Any, args: argparse.Namespace) -> list[dict]:
    """A bf16 GEMM alone, then beside back-to-back all-gathers of ``--overlap-bytes`` per rank."""
    import torch
    import torch.distributed as dist

    n = args.gemm
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    nbytes = args.overlap_nbytes
    x = torch.randn(nbytes // 2, device=dev).to(torch.bfloat16)
    out = torch.empty(x.numel() * world, dtype=torch.bfloat16, device=dev)
    gemm_s, comm_s = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    gemms = 20

    def gemm_window(comm: Optional[Callable[[], Any]], comm_calls: int) -> tuple[float, float]:
        for _ in range(3):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        _cpu_barrier()
        ce0, ce1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if comm is not None:
            with torch.cuda.stream(comm_s):
                ce0.record()
                for _ in range(comm_calls):
                    comm()
                ce1.record()
        with torch.cuda.stream(gemm_s):
            g0.record()
            for _ in range(gemms):
                torch.matmul(a, b, out=c)
            g1.record()
        torch.cuda.synchronize()
        per_comm = ce0.elapsed_time(ce1) * 1000 / comm_calls if comm is not None else 0.0
        return g0.elapsed_time(g1) * 1000 / gemms, per_comm

    rows = []
    solo, _ = gemm_window(None, 0)
    flops = 2.0 * n * n * n
    rows.append(dict(table="overlap", impl="GEMM alone", gemm_us=solo, tflops=flops / solo / 1e6, kept=1.0, comm_us=0.0))
    from mori_core.ccl import AllgatherSdma
    from mori_core.ccl.options import CclOptions

    comms: list[tuple[str, Callable[[], Any], Any]] = []
    for label, opts in (("ce", dict(engine="ce")), ("ce split=1", dict(engine="ce", ce_split=1)),
                        ("sm", dict(engine="sm"))):
        op = AllgatherSdma(rank, world, input_buffer_size=nbytes, output_buffer_size=nbytes * world,
                           options=CclOptions.resolve(**opts))
        comms.append((f"+ ours {label} all-gather", lambda op=op: op(x, out, x.numel(), comm_s), op))
    if not args.no_baselines:
        comms.append(("+ nccl all-gather", lambda: dist.all_gather_into_tensor(out, x), None))
    for name, fn, op in comms:
        try:
            with torch.cuda.stream(comm_s):
                us_ag, _ = _eager(fn, 5, 2)
            # Cover the whole GEMM window. Every rank must make the same number of calls (a
            # collective), so the ranks agree on the largest of their local estimates.
            agreed = torch.tensor([max(4, int(solo * gemms / max(us_ag, 1.0)) + 4)], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # over gloo: no GPU stream involved
            calls = int(agreed.item())
            g_us, c_us = gemm_window(fn, calls)
            rows.append(dict(table="overlap", impl=name, gemm_us=g_us, tflops=flops / g_us / 1e6, kept=solo / g_us,
                             comm_us=c_us, comm_alone_us=us_ag))
        except Exception as e:
            rows.append(dict(table="overlap", impl=name, error=f"{type(e).__name__}: {str(e)[:120]}"))
        if op is not None:
            op.check_error()
            op.close()
    return rows


def _ceilings(rank: int, world: int, dev: Any) -> list[dict]:
    """What cudaMemcpyAsync moves here (64 MiB per peer, on the symmetric heap, every rank at
    once): a local copy; a pairwise pull (rank r from r^1: one link each way, no rank serves two);
    all peers pulled at once with 1, 2 and 4 streams (copies in flight) per peer; all peers
    pushed at once."""
    import torch

    import mori_core.shmem as shmem
    from mori_core.ops.engines.gpu_common import byte_view

    nbytes = 64 * MIB
    src_ptr = shmem.shmem_malloc(nbytes)
    dst_ptr = shmem.shmem_malloc(nbytes * world)
    src = byte_view(src_ptr, nbytes, dev)
    dst = byte_view(dst_ptr, nbytes * world, dev)
    src.fill_(rank)
    peers = [p for p in range(world) if p != rank]
    peer_src = {p: byte_view(shmem.shmem_ptr_p2p(src_ptr, rank, p), nbytes, dev) for p in peers}
    peer_dst = {p: byte_view(shmem.shmem_ptr_p2p(dst_ptr, rank, p) + rank * nbytes, nbytes, dev) for p in peers}
    streams = [torch.cuda.Stream(dev) for _ in range(4 * len(peers))]
    local = byte_view(dst_ptr + rank * nbytes, nbytes, dev)
    shmem.shmem_barrier_all()

    def fan(pairs: list[tuple[Any, Any]], split: int = 1) -> Callable[[], None]:
        """Each (dst, src) copy split into ``split`` pieces, every piece on its own stream."""
        jobs = []
        for d, sr in pairs:
            step = sr.numel() // split
            jobs += [(d[k * step : (k + 1) * step], sr[k * step : (k + 1) * step]) for k in range(split)]

        def go() -> None:
            cur = torch.cuda.current_stream(dev)
            for s, (d, sr) in zip(streams, jobs):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    d.copy_(sr)
            for s in streams[: len(jobs)]:
                cur.wait_stream(s)
        return go

    pulls = [(dst[p * nbytes : (p + 1) * nbytes], peer_src[p]) for p in peers]
    n = len(peers)
    pair = rank ^ 1 if rank ^ 1 < world else peers[0]  # an odd world's last rank shares a peer
    tests = [
        ("local copy", lambda: local.copy_(src), nbytes),
        ("pairwise pull (r from r^1)", lambda: dst[: nbytes].copy_(peer_src[pair]), nbytes),
        (f"{n} peer pulls at once, 1 stream each", fan(pulls), nbytes * n),
        (f"{n} peer pulls at once, 2 streams each", fan(pulls, 2), nbytes * n),
        (f"{n} peer pulls at once, 4 streams each", fan(pulls, 4), nbytes * n),
        (f"{n} peer pushes at once, 1 stream each", fan([(peer_dst[p], src) for p in peers]), nbytes * n),
        (f"{n} peer pushes at once, 2 streams each", fan([(peer_dst[p], src) for p in peers], 2), nbytes * n),
    ]
    tests += _sm_probes(rank, dev, src_ptr, dst_ptr, nbytes, peers, pair)
    rows = []
    for name, fn, moved in tests:
        us, host = _eager(fn, 10, 2)
        rows.append(dict(table="ceilings", impl=name, bytes=moved, us=us, host_us=host))
        shmem.shmem_barrier_all()
    shmem.shmem_free(dst_ptr)
    shmem.shmem_free(src_ptr)
    return rows


# SM link probes (mori_core/csrc/ccl/link_probe.hpp): (name, mode, blocks, warps per block, TMA chunk)
# for all peers at once and for one pair. 132 blocks = one per H100 SM.
LINK_PROBE_MODES = {"push_all": 0, "push_each": 1, "push_tma": 2, "pull": 3}
LINK_PROBES_ALL = [("push 16 B, load once, store to every peer", "push_all", 132, 16, 0),
                   ("push 16 B, load once, store to every peer", "push_all", 264, 8, 0),
                   ("push 16 B, one peer per piece", "push_each", 132, 16, 0),
                   ("push TMA bulk, 4 KiB stages", "push_tma", 132, 8, 4096),
                   ("push TMA bulk, 8 KiB stages", "push_tma", 132, 8, 8192),
                   ("push TMA bulk, 16 KiB stages", "push_tma", 132, 4, 16384),
                   ("pull 16 B", "pull", 132, 16, 0),
                   ("pull 16 B", "pull", 264, 8, 0)]
LINK_PROBES_PAIR = [("push 16 B", "push_all", 132, 16, 0),
                    ("push TMA bulk, 8 KiB stages", "push_tma", 132, 8, 8192),
                    ("pull 16 B", "pull", 132, 16, 0)]


def _sm_probes(rank: int, dev: Any, src_ptr: int, dst_ptr: int, nbytes: int, peers: list[int],
               pair: int) -> list[tuple[str, Callable[[], None], int]]:
    """SM kernels that only move bytes (no routing, no signals): pushes of this rank's ``src`` into
    its slot of every peer's ``dst`` (or of ``pair``'s only), and pulls of the peers' ``src``
    into the own ``dst``. ``(name, call, bytes moved)`` per probe; none in builds without the
    CCL kernels, and no TMA rows where the build or device has no sm_90 bulk copies."""
    import torch

    import mori_core.shmem as shmem
    from mori_core.ccl.gpu import native_ccl

    core = native_ccl()
    if core is None or not hasattr(core, "ccl_link_probe"):
        return []
    stream = torch.cuda.current_stream(dev).cuda_stream
    tma_ok = torch.cuda.get_device_capability(dev)[0] >= 9

    def probe(mode: str, targets: list[int], blocks: int, warps: int, chunk: int) -> Callable[[], None]:
        if mode == "pull":
            addrs = [shmem.shmem_ptr_p2p(src_ptr, rank, p) for p in targets]
        else:
            addrs = [shmem.shmem_ptr_p2p(dst_ptr, rank, p) + rank * nbytes for p in targets]
        args = (LINK_PROBE_MODES[mode], src_ptr, addrs, dst_ptr, nbytes, blocks, warps, chunk or 4096, stream)
        return lambda: core.ccl_link_probe(*args)

    out = []
    for label, targets, table in ((f"{len(peers)} peers at once", peers, LINK_PROBES_ALL),
                                  ("pairwise (r with r^1)", [pair], LINK_PROBES_PAIR)):
        for name, mode, blocks, warps, chunk in table:
            if mode == "push_tma" and not tma_ok:
                continue
            out.append((f"SM {name}, {label}, {blocks}x{warps}", probe(mode, targets, blocks, warps, chunk),
                        nbytes * len(targets)))
    return out


def _sweep(rank: int, world: int, dev: Any, dtype: Any, esize: int, args: argparse.Namespace) -> list[dict]:
    """What is left to pick after the first GPU run: the copy engines' streams per peer
    (``ce_split``) for all-gather / all-to-all / all-reduce, and one-shot vs two-shot for small
    all-reduces inside CUDA graphs (no host time in the way), next to the SM path's grid."""
    import torch

    rows = []
    big = 256 * MIB
    x = torch.randn(big // esize, device=dev).to(dtype)
    out = torch.empty(big // esize * world, dtype=dtype, device=dev)
    ce = [(f"ce split={k}", dict(engine="ce", ce_split=k), (0,)) for k in (1, 2, 4)]
    variants = {
        "allreduce": [("1-shot", dict(engine="sm", oneshot_max_bytes=MIB), (64,)),
                      ("2-shot", dict(engine="sm", oneshot_max_bytes=0), (64, 128))] + ce,
        "allgather": [("sm", dict(engine="sm"), (64, 128))] + ce,
        "all2all": [("sm", dict(engine="sm"), (64, 128))] + ce,
    }
    sizes = {"allreduce": [64 << 10, 256 << 10, 512 << 10, MIB, 16 * MIB, 64 * MIB],
             "allgather": [4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB],
             "all2all": [4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]}
    for kind, vs in variants.items():
        for label, opts, blocks in vs:
            for nb in blocks:
                o = dict(opts, sm_blocks=nb) if nb else dict(opts)
                op = _ours(kind, rank, world, big, dtype, **o)
                for nbytes in sizes[kind]:
                    if kind == "allreduce" and (label == "1-shot" and nbytes > MIB or
                                                label.startswith("ce") and nbytes < 16 * MIB):
                        continue
                    fn = _call(kind, op, x, out, nbytes, esize, world)
                    us, host = _eager(fn, 10 if nbytes <= 8 * MIB else 5, 2)
                    row = dict(table="sweep", kind=kind, impl=label, blocks=nb, bytes=nbytes, us=us, host_us=host)
                    if kind == "allreduce" and nbytes <= MIB:
                        row["graph_us"] = _graph(fn)
                    rows.append(row)
                op.check_error()
                op.close()
    return rows


# ----------------------------------------------------------------------------- rank 0
def _merge(per_rank: dict[int, list[dict]]) -> list[dict]:
    """Row i of every rank: times from the slowest rank (max), host times too."""
    ranks = sorted(per_rank)
    out = []
    for i, row in enumerate(per_rank[ranks[0]]):
        merged = dict(row)
        for key in ("us", "host_us", "graph_us", "gemm_us", "comm_us", "comm_alone_us"):
            vals = [per_rank[r][i].get(key) for r in ranks if per_rank[r][i].get(key) is not None]
            if vals:
                merged[key] = max(vals)
        if "gemm_us" in merged and "tflops" in row:
            kept = [per_rank[r][i].get("kept") for r in ranks if per_rank[r][i].get("kept") is not None]
            merged["kept"] = min(kept) if kept else None
            merged["tflops"] = min(per_rank[r][i]["tflops"] for r in ranks if "tflops" in per_rank[r][i])
        errs = [per_rank[r][i].get("error") for r in ranks if per_rank[r][i].get("error")]
        if errs:
            merged["error"] = errs[0]
        out.append(merged)
    return out


def busbw(kind: str, nbytes: int, us: float, world: int) -> float:
    """Bus bandwidth in GB/s (NCCL's definitions) for ``nbytes`` of input per rank."""
    if not us:
        return 0.0
    factor = {"allreduce": 2 * (world - 1) / world, "allgather": world - 1, "all2all": (world - 1) / world}[kind]
    return factor * nbytes / us / 1e3


def _print(rows: list[dict], world: int, args: argparse.Namespace, gpu: str) -> None:
    hw = f"{world}x {gpu}, {args.dtype}, one rank per GPU"
    for kind in COLLECTIVES:
        lat = [r for r in rows if r["table"] == "latency" and r["kind"] == kind]
        if not lat:
            continue
        nccl = {r["bytes"]: r.get("us") for r in lat if r["impl"] == "nccl"}
        table = []
        for r in lat:
            us = r.get("us")
            base = nccl.get(r["bytes"])
            table.append([fmt_bytes(r["bytes"]), r["impl"], r.get("path", ""),
                          us if us is not None else "n/a", r.get("host_us", "n/a"), r.get("graph_us", ""),
                          busbw(kind, r["bytes"], us, world) if us else "",
                          (base / us) if (us and base) else "", r.get("error", "")])
        print_table(f"{kind}: eager latency per call ({hw})",
                    ["per rank", "impl", "path", "us", "host us", "graph us", "bus GB/s", "NCCL/ours", "error"], table,
                    "us: slowest rank's median of back-to-back calls (event pair per call); host us: the call's wall "
                    "time; graph us: per call, 10 calls per CUDA graph; NCCL/ours > 1: ours faster")
        summary = []
        for nbytes in sorted({r["bytes"] for r in lat}):
            ours = [r for r in lat if r["bytes"] == nbytes and r["impl"].startswith("ours") and r.get("us")]
            best = min(ours, key=lambda r: r["us"]) if ours else None
            symm = [r["us"] for r in lat if r["bytes"] == nbytes and r["impl"].startswith("torch symm") and r.get("us")]
            base = nccl.get(nbytes)
            summary.append([fmt_bytes(nbytes), base or "n/a", min(symm) if symm else "",
                            f"{best['us']:.1f} ({best['impl'][5:]}/{best['path']})" if best else "n/a",
                            busbw(kind, nbytes, best["us"], world) if best else "",
                            busbw(kind, nbytes, base, world) if base else "",
                            (best["us"] / base) if (best and base) else ""])
        print_table(f"{kind}: best of ours vs NCCL ({hw})",
                    ["per rank", "NCCL us", "torch symm us", "ours us (engine/path)", "ours bus GB/s", "NCCL bus GB/s",
                     "ours/NCCL time"], summary)
        graphed = [r for r in lat if r.get("graph_us")]
        if graphed:
            gt = []
            for nbytes in sorted({r["bytes"] for r in graphed}):
                g = {r["impl"]: r["graph_us"] for r in graphed if r["bytes"] == nbytes}
                symm = [v for k, v in g.items() if k.startswith("torch symm")]
                ours = g.get("ours auto")
                gt.append([fmt_bytes(nbytes), g.get("nccl", ""), min(symm) if symm else "", ours or "",
                           (ours / min(symm)) if ours and symm else ""])
            print_table(f"{kind}: inside CUDA graphs, us per call (10 calls per graph; {hw})",
                        ["per rank", "NCCL us", "torch symm us (best)", "ours auto us", "ours/torch symm"], gt)
    ov = [r for r in rows if r["table"] == "overlap"]
    if ov:
        print_table(f"overlap: bf16 GEMM {args.gemm}^3 beside back-to-back all-gathers of {fmt_bytes(args.overlap_nbytes)} "
                    f"per rank ({hw})",
                    ["run", "GEMM us", "GEMM TFLOP/s", "kept vs alone", "all-gather us (beside)", "all-gather us (alone)",
                     "error"],
                    [[r["impl"], r.get("gemm_us", ""), r.get("tflops", ""), r.get("kept", ""), r.get("comm_us", ""),
                      r.get("comm_alone_us", ""), r.get("error", "")] for r in ov],
                    "slowest rank; kept = GEMM throughput beside the all-gathers / alone (target >= 0.95 for ours on "
                    "copy engines)")
    ce = [r for r in rows if r["table"] == "ceilings"]
    if ce:
        print_table(f"link ceilings: cudaMemcpyAsync and SM probe kernels on the symmetric heap ({hw})",
                    ["copy", "bytes", "us", "GB/s", "host us"],
                    [[r["impl"], fmt_bytes(r["bytes"]), r["us"], r["bytes"] / r["us"] / 1e3, r["host_us"]] for r in ce])
    sw = [r for r in rows if r["table"] == "sweep"]
    for kind in COLLECTIVES:
        k = [r for r in sw if r["kind"] == kind]
        if not k:
            continue
        sizes = sorted({r["bytes"] for r in k})
        variants = []
        for r in k:
            v = (r["impl"], r["blocks"])
            if v not in variants:
                variants.append(v)
        table = []
        for impl, nb in variants:
            by = {r["bytes"]: r["us"] for r in k if r["impl"] == impl and r["blocks"] == nb}
            table.append([impl, nb or "-"] + [by.get(s, "") for s in sizes])
        print_table(f"sweep {kind}: us per call (slowest rank's median, eager)", ["variant", "blocks"] +
                    [fmt_bytes(s) for s in sizes], table)
        graph = [r for r in k if r.get("graph_us")]
        if graph:
            gsizes = sorted({r["bytes"] for r in graph})
            gtable = []
            for impl, nb in variants:
                by = {r["bytes"]: r["graph_us"] for r in graph if r["impl"] == impl and r["blocks"] == nb}
                if by:
                    gtable.append([impl, nb or "-"] + [by.get(s, "") for s in gsizes])
            print_table(f"sweep {kind}: us per call inside a CUDA graph (10 calls per graph, slowest rank)",
                        ["variant", "blocks"] + [fmt_bytes(s) for s in gsizes], gtable)
