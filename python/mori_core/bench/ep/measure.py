"""What every EP benchmark shares: rank placement and start-up, routing, the timers (eager, host,
CUDA graph), the NCCL baseline, merging per-rank rows, and what a table may show.

Ranks are placed through :mod:`mori_core.placement` (``MORI_RANKS_PER_GPU=auto|N``): one per GPU
while there are enough GPUs, otherwise several per GPU. When ranks share a GPU the kernels are
time-sliced by the driver, so latencies and bandwidths mean nothing: the benchmarks then skip the
NCCL baseline (NCCL refuses two ranks on one GPU) and the CUDA-graph timing, and print host-time
columns only (:func:`timing_columns_note` says why in the table).
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import time
import traceback
from typing import Any, Callable, Optional

from mori_core.placement import Placement, init_rank_process_group, placement

DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp32": "float32"}
DEFAULT_HEAP_SIZE = "4G"  # mori_core.shmem's default MORI_SHMEM_HEAP_SIZE
RankMain = Callable[[int, int, int, argparse.Namespace, Any], None]
ERROR_GRACE_S = 10.0  # after one rank fails, how long the others may take to report before they are stopped


def progress(rank: int, text: str) -> None:
    """With ``MORI_BENCH_PROGRESS=1``: a line on stderr when a rank starts a part of the benchmark
    (so a log shows where a run that crashed or was killed stopped)."""
    if os.environ.get("MORI_BENCH_PROGRESS", "0") == "1":
        import sys

        print(f"[rank {rank} +{time.monotonic() - _T0:.1f}s] {text}", file=sys.stderr, flush=True)


_T0 = time.monotonic()


# ----------------------------------------------------------------------------- placement
def place_ranks(world: int, heap_request: Optional[str] = None) -> Placement:
    """Placement of ``world`` ranks on the visible GPUs; when they share a GPU, sets
    ``MORI_SHMEM_HEAP_SIZE`` (inherited by the spawned ranks) to ``heap_request`` (default: the
    variable's value, else 4G) scaled so the heaps of the ranks on one GPU fit together."""
    where = placement(world)
    if where.shared:
        requested = heap_request or os.environ.get("MORI_SHMEM_HEAP_SIZE", DEFAULT_HEAP_SIZE)
        os.environ["MORI_SHMEM_HEAP_SIZE"] = where.heap_size(requested)
    return where


def start_rank(rank: int, world: int, port: int, group_name: str = "default") -> Any:
    """In a rank process: join the process group on the rank's GPU (NCCL + gloo with one rank per
    GPU, gloo when ranks share a GPU) and initialise shmem over it; returns the ``torch.device``."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    import mori_core.shmem as shmem

    dev = init_rank_process_group(rank, world, f"tcp://127.0.0.1:{port}")
    torch._C._distributed_c10d._register_process_group(group_name, dist.group.WORLD)
    shmem.shmem_torch_process_group_init(group_name)
    return dev


def run_rank(rank: int, world: int, port: int, results: Any,
             rows_of: Callable[[Any, Callable[[], None]], list[dict]]) -> None:
    """Body of a spawned rank: start it (:func:`start_rank`), collect ``rows_of(device, sync)``,
    finalise shmem and put ``(rank, rows, None)`` on ``results``, or ``(rank, [], traceback)``."""
    import torch
    import torch.distributed as dist

    try:
        dev = start_rank(rank, world, port)
        import mori_core.shmem as shmem

        def sync() -> None:
            torch.cuda.synchronize()
            dist.barrier()

        rows = rows_of(dev, sync)
        shmem.shmem_finalize()
        results.put((rank, rows, None))
    except BaseException:
        results.put((rank, [], traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on localhost (the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(rank_main: RankMain, world: int, args: argparse.Namespace) -> Optional[dict[int, list[dict]]]:
    """Run ``rank_main(rank, world, port, args, queue)`` in one spawned process per rank and gather
    each rank's rows (every rank puts ``(rank, rows, error or None)``). Returns None after printing
    the ranks' errors."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank: dict[int, list[dict]] = {}
    errors = []
    deadline = None  # after a rank's error: the others get ERROR_GRACE_S to report, then are stopped
    while len(per_rank) < world:
        wait = 3600.0 if deadline is None else deadline - time.monotonic()
        try:
            rank, rows, err = q.get(timeout=max(wait, 0.1))
        except queue.Empty:
            missing = sorted(set(range(world)) - set(per_rank))
            errors.append(f"ranks {missing}: no report {ERROR_GRACE_S} s after another rank failed "
                          "(waiting in a collective for it); stopped")
            break
        per_rank[rank] = rows
        if err:
            errors.append(f"rank {rank}:\n{err}")
            print(f"rank {rank} failed; the other ranks get {ERROR_GRACE_S} s to report", flush=True)
            deadline = deadline or time.monotonic() + ERROR_GRACE_S
    for p in procs:
        p.join(timeout=60 if not errors else 2)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    if errors:
        print("\n".join(errors), flush=True)
        return None
    return per_rank


# ----------------------------------------------------------------------------- inputs
def routing(n: int, experts: int, topk: int, gen: Any, device: Any) -> Any:
    """Uniform random top-k routing: ``topk`` distinct experts per token, int32 on ``device``."""
    import torch

    scores = torch.rand(n, experts, generator=gen, device="cpu")
    return scores.topk(topk, dim=1).indices.to(torch.int32).to(device)


def token_inputs(n: int, args: argparse.Namespace, gen: Any, device: Any) -> tuple[Any, Any, Any]:
    """``(indices, bf16 tokens, gating weights)`` of ``n`` tokens (drawn from ``gen`` in this order)."""
    import torch

    idx = routing(n, args.experts, args.topk, gen, device)
    x_bf16 = torch.randn(n, args.hidden, generator=gen).to(torch.bfloat16).to(device)
    w = torch.rand(n, args.topk, generator=gen).to(device)
    return idx, x_bf16, w


def dtype_inputs(x_bf16: Any, dname: str, scale_dim: int, device: Any) -> tuple[Any, Any]:
    """``(tokens in dtype dname, fp32 scales or None)``: fp8 tokens are clamped to +-6 and carry scales."""
    import torch

    dt = getattr(torch, DTYPES[dname])
    x = x_bf16.to(dt) if dname != "fp8" else x_bf16.clamp(-6, 6).to(dt)
    scales = torch.rand(x.shape[0], scale_dim, device=device) if dname == "fp8" and scale_dim else None
    return x, scales


# ----------------------------------------------------------------------------- timers
def time_eager(fn: Callable[[], Any], args: argparse.Namespace, sync: Callable[[], None],
               stats: Optional[dict] = None) -> tuple[float, float, float]:
    """Eager per-call latency, DeepEP's method: calls back to back, an event pair around each.

    Returns ``(median us, mean us, host median us)`` over ``eager_calls - 1`` calls (the first
    is dropped). Host time is ``perf_counter`` around the call itself, inside the event pair.
    ``stats`` (when given) gets ``loop_us``, the host's time per iteration (:func:`_timed_calls`)."""
    for _ in range(args.warmup):
        fn()
    sync()
    us, host_us, loop_us = _timed_calls(fn, max(2, args.eager_calls))
    if stats is not None:
        stats["loop_us"] = loop_us
    return statistics.median(us), statistics.mean(us), host_us


def _timed_calls(fn: Callable[[], Any], n: int) -> tuple[list[float], float, float]:
    """``n`` back-to-back calls of ``fn``, a CUDA event pair around each (DeepEP's method), then
    one synchronisation. Returns the per-call event times (us) of all calls but the first, the
    median host time of the call itself (``perf_counter``, us) and the median host wall time of a
    whole iteration (the call and its two event records, us). When the iteration takes at least
    the event time, the GPU waited for the host between calls: the event time measures the host."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    host_ns, marks = [], []
    for i in range(n):
        marks.append(time.perf_counter_ns())
        starts[i].record()
        t0 = time.perf_counter_ns()
        fn()
        host_ns.append(time.perf_counter_ns() - t0)
        ends[i].record()
    marks.append(time.perf_counter_ns())
    torch.cuda.synchronize()
    us = [s.elapsed_time(e) * 1000 for s, e in zip(starts, ends)][1:]
    loop = statistics.median(b - a for a, b in zip(marks[1:-1], marks[2:])) / 1000
    return us, statistics.median(host_ns[1:]) / 1000, loop


def bench_like_deepep(fn: Callable[[], Any], warmup: int = 50, tests: int = 50) -> dict:
    """DeepEP's ``tests/utils.py bench()`` method, for our calls and DeepEP's alike: the L2 cache
    flushed once (256 MB written) after ``warmup`` calls, then ``tests`` back-to-back calls with a
    CUDA event pair around each. Returns ``mean_us`` (DeepEP's figure), ``median_us`` and
    ``min_us`` over all calls but the first, ``host_us``: the median ``perf_counter`` time of
    the call itself (the host's share), and ``loop_us`` (:func:`_timed_calls`)."""
    import torch

    torch.cuda.synchronize()
    cache = torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda")
    for _ in range(warmup):
        fn()
    cache.zero_()
    us, host_us, loop_us = _timed_calls(fn, max(2, tests))
    del cache
    return dict(mean_us=statistics.mean(us), median_us=statistics.median(us), min_us=min(us), host_us=host_us,
                loop_us=loop_us)


def kernel_breakdown(fn: Callable[[], Any], calls: int) -> dict[str, tuple[float, float]]:
    """Device time of each kernel ``fn`` launches: name -> (mean us per launch, launches per call).

    DeepEP's tests' timer (``bench_kineto(..., barrier_comm_profiling=True)``): a torch profiler
    with a schedule that records only the second of two periods (``wait=1``), each period a large
    matmul and an all-reduce (so the ranks enter it together) and then ``calls`` back-to-back
    calls. The first profiler session of a process starts CUPTI, which takes a different time on
    every rank, so a single period would time the first collective kernel waiting for late peers.
    Kernels of the matmul and the all-reduce are left out (names with "gemm", "nccl", "Kernel2")."""
    import torch
    import torch.distributed as dist

    schedule = torch.profiler.schedule(wait=1, warmup=0, active=1, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule) as prof:
        for _ in range(2):
            lhs = torch.randn((8192, 8192), dtype=torch.float, device="cuda")
            rhs = torch.randn((8192, 8192), dtype=torch.float, device="cuda")
            lhs @ rhs
            dist.all_reduce(torch.ones(1, dtype=torch.float, device="cuda"))
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            prof.step()
    out: dict[str, tuple[float, float]] = {}
    for evt in prof.key_averages():
        key = evt.key
        if any(skip in key for skip in ("gemm", "nccl", "Kernel2", "elementwise", "Memset", "Memcpy")):
            continue
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if evt.count and total:
            out[key] = (total / evt.count, evt.count / calls)
    return out


def time_graph(fn: Callable[[], Any], args: argparse.Namespace, sync: Callable[[], None]) -> Optional[float]:
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


def measure(fn: Callable[[], Any], args: argparse.Namespace, sync: Callable[[], None], **row: Any) -> dict:
    """One table row: eager (median, mean), host and graph times of ``fn`` (``us`` = graph, or
    eager without graphs)."""
    stats: dict = {}
    eager, eager_mean, host = time_eager(fn, args, sync, stats)
    graph = time_graph(fn, args, sync)
    return dict(row, eager_us=eager, eager_mean_us=eager_mean, host_us=host, loop_us=stats["loop_us"],
                us=graph if graph is not None else eager, graph_us=graph)


def host_in_timed_loop(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """``(call us, iteration us)``: medians of the host time of ``fn`` and of a whole iteration of
    the eager timer's loop around it (:func:`_timed_calls`). Their difference is what the two
    event records and the loop cost around this call."""
    import torch

    torch.cuda.synchronize()
    _, host_us, loop_us = _timed_calls(fn, calls)
    return host_us, loop_us


def host_idle(fn: Callable[[], Any], calls: int) -> float:
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


# ----------------------------------------------------------------------------- NCCL baseline
def nccl_baseline(idx: Any, n: int, x: Any, cfg: Any, args: argparse.Namespace, sync: Callable[[], None],
                  dev: Any) -> list[dict]:
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
    fwd = lambda: dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=sc)  # noqa: E731
    back = lambda: dist.all_to_all_single(send, recv, output_split_sizes=sc, input_split_sizes=rc)  # noqa: E731
    out = []
    nbytes = sum(rc) * x.shape[1] * x.element_size()
    # Eager only: NCCL inside CUDA graphs is not relied on.
    eager = argparse.Namespace(**{**vars(args), "no_graph": True})
    for name, fn in (("nccl a2a (dispatch)", fwd), ("nccl a2a (combine)", back)):
        out.append(measure(fn, eager, sync, kernel=name, dtype="bf16", tokens=n, recv=sum(rc), bytes=nbytes, blocks=0,
                           warps=0, mode="-"))
    return out


def shared_gpu_settings(args: argparse.Namespace, where: Placement) -> None:
    """With ranks sharing a GPU: no NCCL baseline and no CUDA-graph timing (printed with why)."""
    if not where.shared:
        return
    print(f"{where.describe()}: skipping the NCCL baseline (NCCL cannot run two ranks on one GPU) and the CUDA-graph "
          "timing; tables show host time only", flush=True)
    args.no_nccl = True
    args.no_graph = True


def timing_columns_note(where: Placement) -> str:
    """The note that replaces latency and bandwidth columns when ranks share a GPU ("" otherwise)."""
    if not where.shared:
        return ""
    return (f"latency and bandwidth columns omitted: not meaningful ({where.ranks_per_gpu} ranks share a GPU; "
            "the driver time-slices their kernels); host time is the wrapper's and still comparable")


# ----------------------------------------------------------------------------- merging
def merge_ranks(per_rank: dict[int, list[dict]]) -> list[dict]:
    """Row i of every rank merged: times as means over ranks, GB/s per rank then averaged."""
    ranks = sorted(per_rank)
    out = []
    for i, row in enumerate(per_rank[ranks[0]]):
        rs = [per_rank[r][i] for r in ranks]
        gbps = statistics.mean(r["bytes"] / (r["us"] * 1e-6) / 1e9 for r in rs)
        gbps_eager = statistics.mean(r["bytes"] / (r["eager_us"] * 1e-6) / 1e9 for r in rs)
        merged = {k: statistics.mean(r[k] for r in rs) for k in ("us", "recv", "eager_us", "eager_mean_us", "host_us")}
        if all("loop_us" in r for r in rs):
            merged["loop_us"] = statistics.mean(r["loop_us"] for r in rs)
        graph = None if row["graph_us"] is None else statistics.mean(r["graph_us"] for r in rs)
        out.append({**row, **merged, "graph_us": graph, "gbps": gbps, "gbps_eager": gbps_eager})
    return out
