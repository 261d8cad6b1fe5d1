"""MORI-CCL on GPUs, one rank per GPU (skipped without enough GPUs): every collective, dtype,
engine (auto, copy engines, SM) and size from 1 element to 256 MiB per rank against NCCL
(torch.distributed) and, for the all-reduce, bit for bit against the rank-order fp32 sum;
unaligned buffers, in place, start_async/wait_async on two streams, CUDA graph capture and
replay, back-to-back calls across engines, bad input, AllGatherIntoTensor through the mori.ccl
alias, the copy engines' copy-signal and unbatched modes, the SM link probe's bytes, and (2 ranks) a missing peer: every
wait ends and the error names the peer.

One spawn per world size runs every case (the GPU section's time budget is small); a failing
case is reported with the others at the end. Run on the GPU machine with tools/gpu/ccl.sh.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest
import torch

from ccl_dist import close_to, init_shmem_rank, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

MIB = 1 << 20
BIG = 256 * MIB
ENGINES = ("auto", "ce", "sm")
AR_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32)
MOVE_DTYPES = (torch.bfloat16, torch.float32, torch.int8)  # all-gather / all-to-all move bytes
SMALL_COUNTS = (1, 7, 1000, 65537, (1 << 20) + 3, 4 << 20)


def _need(world: int) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < world:
        pytest.skip(f"needs {world} GPUs (one rank per GPU), {n} visible")


def _gen(seed: int, rank: int, n: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Deterministic input of ``rank`` on ``dev`` (every rank can rebuild every other's)."""
    g = torch.Generator(device=dev).manual_seed(seed * 1009 + rank)
    if dtype in (torch.int32, torch.uint32):
        return torch.randint(-(2**31), 2**31, (n,), generator=g, device=dev, dtype=torch.int64).to(torch.int32).view(dtype)
    if dtype == torch.int8:
        return torch.randint(-128, 128, (n,), generator=g, device=dev, dtype=torch.int64).to(torch.int8)
    return torch.randn(n, generator=g, device=dev).to(dtype)


def _rank_order_sum(seed: int, world: int, n: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """What every engine must return: fp32 adds in rank order, rounded once (ints mod 2**32)."""
    if dtype in (torch.int32, torch.uint32):
        acc = torch.zeros(n, dtype=torch.int64, device=dev)
        for r in range(world):
            acc = (acc + _gen(seed, r, n, dtype, dev).view(torch.int32).to(torch.int64)) % (2**32)
        return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32).view(dtype)
    acc = _gen(seed, 0, n, dtype, dev).float()
    for r in range(1, world):
        acc += _gen(seed, r, n, dtype, dev).float()
    return acc.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _cpu_barrier() -> None:
    """A barrier over gloo (a GPU stream that is stuck must not hold it up)."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))


class Case:
    """Collects failures instead of stopping at the first, with timings per part."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failures, self.timings = rank, [], []

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)

    def guard(self, label: str, fn: Callable[[], None]) -> None:
        """Run one engine's / case's block; an exception is recorded and the next block runs."""
        try:
            fn()
        except Exception as e:
            self.failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            try:
                torch.cuda.synchronize()
            except Exception:
                pass

    def part(self, name: str, fn: Callable[[], None]) -> None:
        print(f"rank {self.rank}: {name} ...", flush=True)  # where a hang stopped shows in the log
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # report and go on with the other parts
            import traceback

            self.failures.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
        self.timings.append(f"{name} {time.perf_counter() - t0:.1f}s")


def _counts(dtype: torch.dtype) -> tuple[int, ...]:
    return SMALL_COUNTS + (BIG // torch.empty((), dtype=dtype).element_size(),)


def _allreduce(c: Case, rank: int, world: int, dev: torch.device) -> None:
    from mori_core.ccl import AllreduceSdma

    for dtype in AR_DTYPES:
        esize = torch.empty((), dtype=dtype).element_size()
        for engine in ENGINES:
            c.guard(f"allreduce {dtype} {engine}", lambda dtype=dtype, engine=engine, esize=esize:
                    _allreduce_engine(c, rank, world, dev, dtype, engine, esize))
        torch.cuda.synchronize()
    ar = AllreduceSdma(rank, world, input_buffer_size=MIB, output_buffer_size=MIB, dtype=torch.uint32)
    for count in (1, 1000, 100_003):
        x = _gen(count, rank, count, torch.uint32, dev)
        out = torch.empty(count, dtype=torch.uint32, device=dev)
        ar(x, out, count)
        c.check(_same_bits(out, _rank_order_sum(count, world, count, torch.uint32, dev)), f"allreduce uint32 {count}")
    ar.close()


def _allreduce_engine(c: Case, rank: int, world: int, dev: torch.device, dtype: torch.dtype, engine: str,
                      esize: int) -> None:
    from mori_core.ccl import AllreduceSdma

    ar = AllreduceSdma(rank, world, input_buffer_size=BIG, output_buffer_size=BIG, dtype=dtype, engine=engine)
    try:
        _allreduce_cases(c, ar, rank, world, dev, dtype, engine, esize)
    finally:
        ar.close()


def _allreduce_cases(c: Case, ar: Any, rank: int, world: int, dev: torch.device, dtype: torch.dtype, engine: str,
                     esize: int) -> None:
    import torch.distributed as dist

    for count in _counts(dtype):
        seed = count % 9973 + 17 * esize
        x = _gen(seed, rank, count, dtype, dev)
        out = torch.empty(count + 8, dtype=dtype, device=dev)
        guard = out[count:].clone()
        ar(x, out, count)
        want = _rank_order_sum(seed, world, count, dtype, dev)
        tag = f"allreduce {dtype} {engine}({ar.last_path}) count={count}"
        c.check(_same_bits(out[:count], want), f"{tag}: differs from the rank-order sum")
        c.check(_same_bits(out[count:], guard), f"{tag}: wrote past count")
        ref = x.clone().view(torch.int32) if dtype == torch.uint32 else x.clone()
        dist.all_reduce(ref)
        c.check(close_to(out[:count], ref.view(dtype), dtype, world), f"{tag}: differs from NCCL")
        del x, out, want, ref
    # unaligned buffers (scalar path), in place, and a second call on the same buffers
    n = 65537 if engine != "ce" else (1 << 20) + 5
    seed = 4242 + esize
    base = torch.zeros(n + 1, dtype=dtype, device=dev)
    base[1:] = _gen(seed, rank, n, dtype, dev)
    outb = torch.zeros(n + 1, dtype=dtype, device=dev)
    ar(base[1:], outb[1:], n)
    want = _rank_order_sum(seed, world, n, dtype, dev)
    c.check(_same_bits(outb[1:], want), f"allreduce {dtype} {engine} unaligned: differs")
    ar.allreduce_inplace(base[1:], n)
    c.check(_same_bits(base[1:], want), f"allreduce {dtype} {engine} in place: differs")


def _move(c: Case, rank: int, world: int, dev: torch.device, kind: str) -> None:
    from mori_core.ccl import All2allSdma, AllgatherSdma

    for dtype in MOVE_DTYPES:
        for engine in ENGINES:
            if kind == "allgather":
                op = AllgatherSdma(rank, world, input_buffer_size=BIG, output_buffer_size=BIG * world, engine=engine)
            else:
                op = All2allSdma(rank, world, input_buffer_size=BIG, output_buffer_size=BIG, engine=engine)
            try:
                c.guard(f"{kind} {dtype} {engine}", lambda op=op, dtype=dtype, engine=engine:
                        _move_cases(c, op, rank, world, dev, kind, dtype, engine))
            finally:
                op.close()
        torch.cuda.synchronize()


def _move_cases(c: Case, op: Any, rank: int, world: int, dev: torch.device, kind: str, dtype: torch.dtype,
                engine: str) -> None:
    import torch.distributed as dist

    esize = torch.empty((), dtype=dtype).element_size()
    for count in _counts(dtype):
        per = count if kind == "allgather" else max(count // world, 1)
        n_in = per if kind == "allgather" else per * world
        x = _gen(per % 7919 + esize, rank, n_in, dtype, dev)
        out = torch.empty(world * per + 8, dtype=dtype, device=dev)
        guard = out[world * per :].clone()
        op(x, out, per)
        ref = torch.empty(world * per, dtype=dtype, device=dev)
        if kind == "allgather":
            dist.all_gather_into_tensor(ref, x)
        else:
            dist.all_to_all_single(ref, x)
        tag = f"{kind} {dtype} {engine}({op.last_path}) count={per}"
        c.check(_same_bits(out[: world * per], ref), f"{tag}: differs from NCCL")
        c.check(_same_bits(out[world * per :], guard), f"{tag}: wrote past the output")
        del x, out, ref
    # unaligned (1-byte offsets for int8) and, for all-gather, in place
    per = 1001
    xb = torch.zeros(per * world + 1, dtype=dtype, device=dev)
    n_in = per if kind == "allgather" else per * world
    xb[1 : 1 + n_in] = _gen(99, rank, n_in, dtype, dev)
    ob = torch.zeros(per * world + 1, dtype=dtype, device=dev)
    op(xb[1 : 1 + n_in], ob[1:], per)
    ref = torch.empty(world * per, dtype=dtype, device=dev)
    if kind == "allgather":
        dist.all_gather_into_tensor(ref, xb[1 : 1 + n_in].contiguous())
        inplace = torch.zeros(world * per, dtype=dtype, device=dev)
        inplace[rank * per : (rank + 1) * per] = xb[1 : 1 + per]
        op(inplace[rank * per : (rank + 1) * per], inplace, per)
        c.check(_same_bits(inplace, ref), f"{kind} {dtype} {engine} in place: differs")
    else:
        dist.all_to_all_single(ref, xb[1 : 1 + n_in].contiguous())
    c.check(_same_bits(ob[1:], ref), f"{kind} {dtype} {engine} unaligned: differs")


def _graphs_async(c: Case, rank: int, world: int, dev: torch.device) -> None:
    """CUDA graph capture + replay (two calls per graph, and start/wait inside the capture), and
    start_async on one stream with wait_async on another, for every engine path."""
    from mori_core.ccl import All2allSdma, AllgatherSdma, AllreduceSdma

    cases = []  # (label, op, kind, count, dtype)
    for engine, count in (("sm", 4096), ("sm", 3 << 20), ("ce", 3 << 20), ("auto", 24 << 20)):
        cases.append((f"allreduce {engine} {count}", AllreduceSdma(rank, world, input_buffer_size=64 * MIB,
                      output_buffer_size=64 * MIB, dtype=torch.bfloat16, engine=engine), "allreduce", count))
    for engine in ("sm", "ce"):
        cases.append((f"allgather {engine}", AllgatherSdma(rank, world, input_buffer_size=8 * MIB, engine=engine),
                      "allgather", 1 << 20))
        cases.append((f"all2all {engine}", All2allSdma(rank, world, input_buffer_size=8 * MIB,
                      output_buffer_size=8 * MIB, engine=engine), "all2all", 1 << 18))

    def expected(kind: str, seed: int, count: int) -> torch.Tensor:
        if kind == "allreduce":
            return _rank_order_sum(seed, world, count, torch.bfloat16, dev)
        if kind == "allgather":
            return torch.cat([_gen(seed, r, count, torch.bfloat16, dev) for r in range(world)])
        return torch.cat([_gen(seed, r, count * world, torch.bfloat16, dev)[rank * count : (rank + 1) * count]
                          for r in range(world)])

    for label, op, kind, count in cases:
        try:
            c.guard(f"graph/async {label}", lambda label=label, op=op, kind=kind, count=count:
                    _graph_case(c, rank, world, dev, label, op, kind, count, expected))
        finally:
            op.close()


def _graph_case(c: Case, rank: int, world: int, dev: torch.device, label: str, op: Any, kind: str, count: int,
                expected: Callable[[str, int, int], torch.Tensor]) -> None:
    n_in = count * world if kind == "all2all" else count
    n_out = count * world if kind != "allreduce" else count
    x = torch.zeros(n_in, dtype=torch.bfloat16, device=dev)
    out1 = torch.zeros(n_out, dtype=torch.bfloat16, device=dev)
    out2 = torch.zeros_like(out1)
    out3 = torch.zeros_like(out1)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    _cpu_barrier()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        op(x, out1, count)
        op(x, out2, count)
        op.start_async(x, out3, count)
        op.wait_async()
    torch.cuda.synchronize()
    for replay in range(3):
        seed = 500 + replay
        x.copy_(_gen(seed, rank, n_in, torch.bfloat16, dev))
        for o in (out1, out2, out3):
            o.zero_()
        torch.cuda.synchronize()
        _cpu_barrier()
        graph.replay()
        torch.cuda.synchronize()
        want = expected(kind, seed, count)
        for i, o in enumerate((out1, out2, out3)):
            c.check(_same_bits(o, want), f"graph {label} replay {replay} call {i}: differs")
    op.check_error()
    del graph
    # eager async: start on one stream, a GEMM there, wait on another
    seed = 900
    x.copy_(_gen(seed, rank, n_in, torch.bfloat16, dev))
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    a = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    with torch.cuda.stream(s1):
        op.start_async(x, out1, count, s1)
        _ = a @ a
    c.check(op.is_async_in_progress(), f"async {label}: not in progress after start_async")
    op.wait_async(s2)
    s2.synchronize()
    c.check(_same_bits(out1, expected(kind, seed, count)), f"async {label}: differs")


def _back_to_back(c: Case, rank: int, world: int, dev: torch.device) -> None:
    """40 calls without a synchronisation in between, alternating one-shot, two-shot and copy
    engines on one handle (the flag protocols of all paths interleaved)."""
    from mori_core.ccl import AllreduceSdma

    from mori_core.ccl.options import CclOptions

    sizes = [1000, 300_000, 8 << 20, 17, 2 << 20]  # fp32 elements: one-shot, two-shot, copy engines, ...
    opts = CclOptions.resolve(oneshot_max_bytes=64 << 10, ar_ce_min_bytes=4 * MIB)
    ar = AllreduceSdma(rank, world, input_buffer_size=32 * MIB, output_buffer_size=32 * MIB, dtype=torch.float32,
                       options=opts)
    paths = set()
    outs = []
    for i in range(40):
        n = sizes[i % len(sizes)]
        x = _gen(i, rank, n, torch.float32, dev)
        out = torch.empty(n, dtype=torch.float32, device=dev)
        ar(x, out, n)
        paths.add(ar.last_path)
        outs.append((i, n, out, x))
    torch.cuda.synchronize()
    for i, n, out, _ in outs:
        c.check(_same_bits(out, _rank_order_sum(i, world, n, torch.float32, dev)), f"back-to-back call {i} (n={n}) differs")
    c.check(paths == {"sm-oneshot", "sm-twoshot", "ce"}, f"back-to-back used paths {sorted(paths)}")
    ar.close()


def _bad_input(c: Case, rank: int, world: int, dev: torch.device) -> None:
    from mori_core.ccl import AllreduceSdma

    ar = AllreduceSdma(rank, world, input_buffer_size=4096, output_buffer_size=4096, dtype=torch.bfloat16)
    x = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    out = torch.zeros(4096, dtype=torch.bfloat16, device=dev)
    other = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
    for fn, pattern in (
        (lambda: ar(x, out, 2049), "more than input_buffer_size=4096"),
        (lambda: ar(x.float(), out.float(), 8), "built for dtype=torch.bfloat16"),
        (lambda: ar(x.to(other), out, 8), f"input_data is on {other}"),
        (lambda: ar(x, out.cpu(), 8), "output_data is on cpu"),
    ):
        try:
            fn()
            c.failures.append(f"bad input not refused (expected {pattern!r})")
        except ValueError as e:
            c.check(pattern in str(e), f"bad input message {e!r} lacks {pattern!r}")
    ar(x, out, 2048)  # nothing lost: the handle still works
    torch.cuda.synchronize()
    c.check(bool((out[:2048] == world).all()), "all-reduce after refused calls differs")
    ar.close()


def _into_tensor(c: Case, rank: int, world: int, dev: torch.device) -> None:
    """upstream's NCCL-style entry point through the alias: raw addresses, a DataType, an int
    stream handle; sync and async, byte counts that are not a multiple of 4."""
    import mori.ccl as mccl

    agit = mccl.AllGatherIntoTensor(my_pe=rank, npes=world, input_buffer_size=MIB, output_buffer_size=MIB * world,
                                    copy_output_to_user=True, auto_register=False)
    for dt, tdt, n in ((mccl.DataType.BFloat16, torch.bfloat16, 4097), (mccl.DataType.Int8, torch.int8, 3),
                       (mccl.DataType.Float64, torch.float64, 1000)):
        x = _gen(n, rank, n, torch.float32 if tdt == torch.float64 else tdt, dev).to(tdt)
        out = torch.zeros(world * n, dtype=tdt, device=dev)
        s = torch.cuda.current_stream(dev).cuda_stream
        c.check(agit(x.data_ptr(), out.data_ptr(), n, dt, s) is True, "AllGatherIntoTensor did not return True")
        ref = torch.cat([_gen(n, r, n, torch.float32 if tdt == torch.float64 else tdt, dev).to(tdt) for r in range(world)])
        torch.cuda.synchronize()
        c.check(_same_bits(out, ref), f"AllGatherIntoTensor {dt!r} n={n}: differs")
        out.zero_()
        agit.start_async(x.data_ptr(), out.data_ptr(), n, dt, s)
        agit.wait_async(s)
        torch.cuda.synchronize()
        c.check(_same_bits(out, ref), f"AllGatherIntoTensor async {dt!r} n={n}: differs")
    agit.close()


def _ce_modes(c: Case, rank: int, world: int, dev: torch.device) -> None:
    """The copy-engine path's other modes: peers signalled by 4-byte copies instead of stream
    write operations, unbatched stream memory operations, one stream per peer (no split) and
    uneven splits (3 pieces of >= 256 KiB: the last one shorter)."""
    from mori_core.ccl import AllgatherSdma, AllreduceSdma
    from mori_core.ccl.options import CclOptions

    n = (1 << 20) + 1
    for mode in (dict(ce_signal="copy"), dict(ce_batch=False), dict(ce_split=1),
                 dict(ce_split=3, ce_piece_min_bytes=256 << 10)):
        opts = CclOptions.resolve(engine="ce", **mode)
        ag = AllgatherSdma(rank, world, input_buffer_size=4 * MIB, options=opts)
        ar = AllreduceSdma(rank, world, input_buffer_size=4 * MIB, output_buffer_size=4 * MIB, dtype=torch.bfloat16,
                           options=opts)
        try:
            def run() -> None:
                for it in range(3):
                    x = _gen(it, rank, n, torch.bfloat16, dev)
                    out = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
                    ag(x, out, n)
                    want = torch.cat([_gen(it, r, n, torch.bfloat16, dev) for r in range(world)])
                    c.check(_same_bits(out, want), f"ce {mode} all-gather call {it}: differs")
                    red = torch.empty(n, dtype=torch.bfloat16, device=dev)
                    ar(x, red, n)
                    c.check(_same_bits(red, _rank_order_sum(it, world, n, torch.bfloat16, dev)),
                            f"ce {mode} all-reduce call {it}: differs")

            c.guard(f"ce {mode}", run)
        finally:
            ag.close()
            ar.close()


def _missing_peer(c: Case, rank: int, world: int, dev: torch.device) -> None:
    """Rank 0 calls, rank 1 never does: rank 0's GPU work still ends (bounded waits) and the
    error names rank 1, for the SM engine and the copy engines."""
    from mori_core.ccl import AllgatherSdma, AllreduceSdma
    from mori_core.ccl.options import CclOptions

    opts = CclOptions.resolve(timeout_s=1.0)
    for label, op, count in (
        ("sm", AllreduceSdma(rank, world, input_buffer_size=MIB, output_buffer_size=MIB, dtype=torch.bfloat16,
                             engine="sm", options=opts), 1000),
        ("ce", AllgatherSdma(rank, world, input_buffer_size=MIB, engine="ce", options=opts), 1000),
    ):
        _cpu_barrier()
        if rank == 0:
            x = torch.ones(count, dtype=torch.bfloat16, device=dev)
            out = torch.zeros(count * world, dtype=torch.bfloat16, device=dev)
            t0 = time.monotonic()
            op(x, out, count)
            torch.cuda.synchronize()
            waited = time.monotonic() - t0
            c.check(waited < 10, f"missing peer ({label}): the GPU work took {waited:.1f} s to end")
            try:
                op.check_error()
                c.failures.append(f"missing peer ({label}): no error")
            except RuntimeError as e:
                c.check("rank 1" in str(e), f"missing peer ({label}): {e!r} does not name rank 1")
            try:
                op(x, out, count)
                c.failures.append(f"missing peer ({label}): a failed handle accepted a call")
            except RuntimeError as e:
                c.check("cannot be used again" in str(e), f"missing peer ({label}): {e!r}")
        _cpu_barrier()
        op.close()  # bounded on both ranks (rank 1's close barrier ends by the timeout at worst)


def _link_probe(c: Case, rank: int, world: int, dev: torch.device) -> None:
    """The SM link probe of `bench ccl --ceilings` moves exactly the bytes it times: every push
    mode lands this rank's bytes in its slot of every peer's buffer, the pull brings every peer's
    bytes here (a size that is not a whole number of pieces, and a one-block grid); bad input is
    refused with the argument named."""
    import mori_core.shmem as shmem
    from mori_core import _C
    from mori_core.ops.engines.gpu_common import byte_view

    n = MIB + 48
    src_ptr, dst_ptr = shmem.shmem_malloc(n), shmem.shmem_malloc(n * world)
    try:
        src, dst = byte_view(src_ptr, n, dev), byte_view(dst_ptr, n * world, dev)
        src.copy_(_gen(7, rank, n, torch.int8, dev).view(torch.uint8))
        peers = [p for p in range(world) if p != rank]
        stream = torch.cuda.current_stream(dev).cuda_stream
        modes = [("push_all", 0), ("push_each", 1), ("pull", 3)]
        if torch.cuda.get_device_capability(dev)[0] >= 9:
            modes.insert(2, ("push_tma", 2))
        for name, mode in modes:
            for blocks, warps, chunk in ((132, 8, 4096), (1, 2, 8192)):
                dst.zero_()
                shmem.shmem_barrier_all()
                if mode == 3:
                    targets = [shmem.shmem_ptr_p2p(src_ptr, rank, p) for p in peers]
                else:
                    targets = [shmem.shmem_ptr_p2p(dst_ptr, rank, p) + rank * n for p in peers]
                _C.ccl_link_probe(mode, src_ptr, targets, dst_ptr, n, blocks, warps, chunk, stream)
                torch.cuda.synchronize()
                shmem.shmem_barrier_all()
                for i, p in enumerate(peers):
                    got = dst[i * n:(i + 1) * n] if mode == 3 else dst[p * n:(p + 1) * n]
                    c.check(torch.equal(got, _gen(7, p, n, torch.int8, dev).view(torch.uint8)),
                            f"link probe {name} {blocks}x{warps}: bytes of rank {p} differ")
        for kwargs, pattern in ((dict(bytes=n - 8), "bytes: a positive multiple of 16"),
                                (dict(targets=[]), "targets: 1 to 8"),
                                (dict(mode=9), "mode: 0 (push_all)"),
                                (dict(warps=64), "warps: 1 to 32"),
                                (dict(mode=2, chunk=40), "chunk: a multiple of 16")):
            args = dict(mode=0, src=src_ptr, targets=[dst_ptr], local_dst=dst_ptr, bytes=n, blocks=1, warps=1,
                        chunk=4096, stream=stream)
            args.update(kwargs)
            if kwargs.get("mode") == 2 and torch.cuda.get_device_capability(dev)[0] < 9:
                continue
            try:
                _C.ccl_link_probe(**args)
                c.failures.append(f"link probe: {kwargs} not refused")
            except ValueError as e:
                c.check(pattern in str(e), f"link probe: {e!r} lacks {pattern!r}")
        torch.cuda.synchronize()
    finally:
        shmem.shmem_barrier_all()
        shmem.shmem_free(dst_ptr)
        shmem.shmem_free(src_ptr)


def _suite(rank: int, world: int, missing_peer: bool) -> None:
    dev = init_shmem_rank(rank, world)
    c = Case(rank)
    c.part("allreduce", lambda: _allreduce(c, rank, world, dev))
    c.part("allgather", lambda: _move(c, rank, world, dev, "allgather"))
    c.part("all2all", lambda: _move(c, rank, world, dev, "all2all"))
    c.part("graphs+async", lambda: _graphs_async(c, rank, world, dev))
    c.part("back-to-back", lambda: _back_to_back(c, rank, world, dev))
    c.part("bad input", lambda: _bad_input(c, rank, world, dev))
    c.part("into tensor", lambda: _into_tensor(c, rank, world, dev))
    c.part("ce modes", lambda: _ce_modes(c, rank, world, dev))
    c.part("link probe", lambda: _link_probe(c, rank, world, dev))
    if missing_peer:
        c.part("missing peer", lambda: _missing_peer(c, rank, world, dev))
    import mori_core.shmem as shmem

    shmem.shmem_finalize()
    print(f"rank {rank} parts: {', '.join(c.timings)}", flush=True)
    assert not c.failures, f"rank {rank}: {len(c.failures)} failure(s):\n" + "\n".join(c.failures[:40])


@pytest.mark.parametrize("world", [2, 4])
def test_ccl_gpu_suite(world: int) -> None:
    _need(world)
    run_ranks(_suite, world, backend="nccl", timeout=float(os.environ.get("CCL_TEST_TIMEOUT", "150")),
              env={"MORI_SHMEM_HEAP_SIZE": os.environ.get("MORI_SHMEM_HEAP_SIZE", "6G")}, missing_peer=world == 2)
