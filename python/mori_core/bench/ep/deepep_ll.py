"""DeepEP's low-latency mode as a same-run baseline of the inter-node benchmark.

``python -m mori_core.bench ep --kernel-type InterNodeV1LL,... --deepep-ll`` runs, after the
inter-node kernels, DeepEP v1.2.1's ``low_latency_dispatch`` / ``low_latency_combine`` in the same
invocation on the same data: the same seeds draw the same routing, tokens and gating weights
(:func:`mori_core.bench.ep.measure.token_inputs`) on every rank. DeepEP is never a dependency of
mori-suite: it is imported only here, from ``PYTHONPATH`` (``tools/gpu/deepep_build.sh`` builds
it), and a missing DeepEP is reported and skipped.

DeepEP runs in processes of its own (one per GPU, as ours): both libraries link NVSHMEM's device
library statically and initialise NVSHMEM themselves, so they cannot share a process.

Timers: the eager per-call CUDA-event latency and host time of ``measure.time_eager`` (as for our
kernels), and DeepEP's own timer (its tests' ``bench_kineto``: the mean kernel time of the
``dispatch``/``combine`` kernels in a torch profiler trace). FP8 dispatch is DeepEP's own: BF16
tokens in, cast to FP8 with per-128-channel scales inside the kernel (ours takes FP8 tokens and 56
fp32 scales: the same bytes on the wire). Combine is BF16 with the gating weights, not zero-copy
(DeepEP's default, the one its tests time).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from typing import Any, Callable, Optional

from mori_core.bench.ep.measure import spawn_ranks, time_eager, token_inputs

# Token counts the baseline runs: DeepEP's low-latency buffers hold every expert's slots for
# max_tokens rows of every rank (about 2 GB per 512 tokens at hidden 7168 and 256 experts, four
# times over), and decode batches are what the mode is for.
MAX_LL_TOKENS = 1024


def ll_tokens(tokens: str) -> list[int]:
    """The benchmark's token counts the low-latency baseline runs (those <= MAX_LL_TOKENS)."""
    return [int(t) for t in tokens.split(",") if int(t) <= MAX_LL_TOKENS]


def available() -> tuple[bool, str]:
    """(True, "") when ``deep_ep`` imports, else (False, why)."""
    try:
        import deep_ep  # noqa: F401
    except Exception as e:  # ImportError, or its extension failing to load
        return False, f"deep_ep not importable ({type(e).__name__}: {e}); build it with tools/gpu/deepep_build.sh"
    return True, ""


def kernel_time_us(fn: Callable[[], Any], calls: int, name: str) -> Optional[float]:
    """Mean device time per launch of the kernels of ``fn`` whose name contains ``name``, by
    DeepEP's tests' timer (:func:`~mori_core.bench.ep.measure.kernel_breakdown`); None when no
    such kernel was recorded."""
    from mori_core.bench.ep.measure import kernel_breakdown

    total, count = 0.0, 0.0
    for key, (us, per_call) in kernel_breakdown(fn, calls).items():
        if name in key:
            total += us * per_call
            count += per_call
    return total / count if count else None


def _received_rows(idx: Any, world: int, experts_per_rank: int) -> int:
    """Rows this rank receives under MORI's convention (one per source token and destination
    rank), from every rank's routing (all_gather), so GB/s matches the mori-suite rows."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    all_idx = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(all_idx, idx)
    rows = 0
    for src in all_idx:
        hits = ((src >= 0) & (src // experts_per_rank == rank)).any(dim=1)
        rows += int(hits.sum())
    return rows


def _rank_rows(rank: int, world: int, args: argparse.Namespace, dev: Any, sync: Callable[[], None]) -> list[dict]:
    """One rank of the baseline: the rows (same keys as the inter-node benchmark's)."""
    import torch
    import torch.distributed as dist

    import deep_ep

    all_tokens = [int(t) for t in args.tokens.split(",")]
    tokens = ll_tokens(args.tokens)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    max_tok = max(tokens)
    experts_per_rank = args.experts // world
    nbytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tok, args.hidden, world, args.experts)
    buf = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=nbytes, low_latency_mode=True,
                         num_qps_per_rank=experts_per_rank, allow_nvlink_for_low_latency_mode=True,
                         explicitly_destroy=True)
    eager = argparse.Namespace(**{**vars(args), "no_graph": True})
    rows: list[dict] = []
    try:
        gen = torch.Generator().manual_seed(args.seed * 7919 + rank)  # the inter-node benchmark's draws
        for n in all_tokens:
            idx, x_bf16, w = token_inputs(n, args, gen, dev)  # drawn for every count, as there
            if n not in tokens:
                continue
            topk = idx.to(torch.int64)
            recv = _received_rows(idx, world, experts_per_rank)
            for dname in dtypes:
                if dname not in ("fp8", "bf16"):
                    continue
                fp8 = dname == "fp8"
                fn = functools.partial(buf.low_latency_dispatch, x_bf16, topk, max_tok, args.experts, use_fp8=fp8,
                                       async_finish=False, return_recv_hook=False)
                eager_us, eager_mean, host = time_eager(fn, eager, sync)
                sync()
                kern = kernel_time_us(fn, 20, "dispatch")
                rows.append(dict(kernel="DeepEP LL dispatch", path="-", dtype=dname, tokens=n, recv=recv,
                                 net_rows=0, bytes=recv * args.hidden * (1 if fp8 else 2), eager_us=eager_us,
                                 eager_mean_us=eager_mean, host_us=host, us=eager_us, graph_us=None,
                                 kernel_us=kern, phases={}))
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x_bf16, topk, max_tok, args.experts, use_fp8=False)
            fn = functools.partial(buf.low_latency_combine, recv_x, topk, w, handle)
            eager_us, eager_mean, host = time_eager(fn, eager, sync)
            sync()
            kern = kernel_time_us(fn, 20, "combine")
            rows.append(dict(kernel="DeepEP LL combine", path="-", dtype="bf16", tokens=n, recv=recv, net_rows=0,
                             bytes=recv * args.hidden * 2, eager_us=eager_us, eager_mean_us=eager_mean, host_us=host,
                             us=eager_us, graph_us=None, kernel_us=kern, phases={}))
    finally:
        sync()
        buf.destroy()
    return rows


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """Entry of one spawned DeepEP rank (process group over NCCL, no mori shmem)."""
    import traceback

    import torch.distributed as dist

    from mori_core.placement import init_rank_process_group

    try:
        dev = init_rank_process_group(rank, world, f"tcp://127.0.0.1:{port}")

        def sync() -> None:
            import torch

            torch.cuda.synchronize()
            dist.barrier()

        results.put((rank, _rank_rows(rank, world, args, dev, sync), None))
    except BaseException:
        results.put((rank, [], traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_baseline(args: argparse.Namespace, world: int) -> list[dict]:
    """Spawn the DeepEP ranks and return their rows merged over ranks (means; GB/s per rank, then
    averaged), or [] with a printed reason when DeepEP is missing or failed."""
    ok, why = available()
    if not ok:
        print(f"DeepEP low-latency baseline skipped: {why}", flush=True)
        return []
    if not ll_tokens(args.tokens):
        print(f"DeepEP low-latency baseline skipped: no token count <= {MAX_LL_TOKENS} in --tokens", flush=True)
        return []
    skipped = [t for t in args.tokens.split(",") if int(t) > MAX_LL_TOKENS]
    if skipped:
        print(f"DeepEP low-latency baseline: token counts {','.join(skipped)} skipped (> {MAX_LL_TOKENS})", flush=True)
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    per_rank = spawn_ranks(rank_main, world, args)
    if per_rank is None:
        print("DeepEP low-latency baseline failed (tracebacks above)", flush=True)
        return []
    ranks = sorted(per_rank)
    out = []
    for i, row in enumerate(per_rank[ranks[0]]):
        rs = [per_rank[r][i] for r in ranks]
        merged = {k: statistics.mean(r[k] for r in rs) for k in ("eager_us", "eager_mean_us", "host_us", "us", "recv")}
        kern = [r["kernel_us"] for r in rs if r["kernel_us"] is not None]
        out.append({**row, **merged, "kernel_us": statistics.mean(kern) if kern else None,
                    "gbps": statistics.mean(r["bytes"] / (r["eager_us"] * 1e-6) / 1e9 for r in rs)})
    return out
