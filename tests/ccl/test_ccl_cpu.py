"""MORI-CCL's CPU reference (gloo) at 2 and 4 ranks: every collective and dtype against
torch.distributed, async, the output transit buffer, in place, AllGatherIntoTensor, and the
argument errors (each names the argument and the limit, and leaves the handle usable).
One spawn per world size runs every case, so CI pays the process start-up twice."""

from __future__ import annotations


import pytest
import torch

from ccl_dist import FLOAT_DTYPES, INT_DTYPES, close_to, rank_input, rank_order_sum, run_ranks

COUNTS = (1, 7, 1000, 4099)


def _reference(kind: str, xs: torch.Tensor, rank: int, world: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.distributed's answer (gloo) for this rank's input ``xs``."""
    import torch.distributed as dist

    if kind == "allreduce":
        y = xs[:count].clone().view(torch.int32) if dtype == torch.uint32 else xs[:count].clone()
        dist.all_reduce(y)
        return y.view(dtype)
    if kind == "allgather":
        src = xs[:count].view(torch.uint8) if dtype == torch.uint32 else xs[:count]
        parts = [torch.empty_like(src) for _ in range(world)]
        dist.all_gather(parts, src)
        return torch.cat(parts).view(dtype)
    src = xs[: world * count].view(torch.int32) if dtype == torch.uint32 else xs[: world * count]
    y = torch.empty_like(src)
    dist.all_to_all_single(y, src)
    return y.view(dtype)


def _collectives(rank: int, world: int, failures: list[str]) -> None:
    from mori_core.ccl import All2allSdma, AllgatherSdma, AllreduceSdma

    limit = 4099 * world * 4
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        ar = AllreduceSdma(rank, world, input_buffer_size=limit, output_buffer_size=limit, dtype=dtype)
        ag = AllgatherSdma(rank, world, input_buffer_size=limit, output_buffer_size=limit * world)
        a2a = All2allSdma(rank, world, input_buffer_size=limit * world, output_buffer_size=limit * world)
        for count in COUNTS:
            seed = count * 31 + len(str(dtype))
            xs = [rank_input(seed, r, world * count, dtype) for r in range(world)]
            x = xs[rank]
            # all-reduce: against gloo (tolerance) and the rank-order sum (bit for bit)
            out = torch.full((count + 3,), 7, dtype=torch.int32 if dtype == torch.uint32 else dtype).view(dtype)
            tail = out[count:].clone()
            assert ar(x, out, count) is True
            want = rank_order_sum([v[:count] for v in xs])
            if not torch.equal(out[:count].view(torch.uint8), want.view(torch.uint8)):
                failures.append(f"allreduce {dtype} count={count}: differs from the rank-order sum")
            if not close_to(out[:count], _reference("allreduce", x, rank, world, count, dtype), dtype, world):
                failures.append(f"allreduce {dtype} count={count}: differs from torch.distributed")
            if not torch.equal(out[count:].view(torch.uint8), tail.view(torch.uint8)):
                failures.append(f"allreduce {dtype} count={count}: wrote past count")
            # all-gather
            gout = torch.zeros(world * count, dtype=torch.int32 if dtype == torch.uint32 else dtype).view(dtype)
            assert ag(x, gout, count) is True
            if not torch.equal(gout.view(torch.uint8), _reference("allgather", x, rank, world, count, dtype).view(torch.uint8)):
                failures.append(f"allgather {dtype} count={count}: differs from torch.distributed")
            if not torch.equal(gout.view(world, count)[1 % world].view(torch.uint8), xs[1 % world][:count].view(torch.uint8)):
                failures.append(f"allgather {dtype} count={count}: rank 1's chunk is not rank 1's input")
            # all-to-all
            aout = torch.zeros(world * count, dtype=torch.int32 if dtype == torch.uint32 else dtype).view(dtype)
            t = a2a(x, aout, count)
            if not (isinstance(t, float) and t >= 0):
                failures.append(f"all2all returned {t!r}, expected host seconds")
            if not torch.equal(aout.view(torch.uint8), _reference("all2all", x, rank, world, count, dtype).view(torch.uint8)):
                failures.append(f"all2all {dtype} count={count}: differs from torch.distributed")
            src = (rank + 1) % world
            if not torch.equal(aout[src * count : (src + 1) * count].view(torch.uint8),
                               xs[src][rank * count : (rank + 1) * count].view(torch.uint8)):
                failures.append(f"all2all {dtype} count={count}: chunk from rank {src} misplaced")
        for h in (ar, ag, a2a):
            h.close()


def _modes(rank: int, world: int, failures: list[str]) -> None:
    import mori.ccl
    from mori_core.ccl import AllGatherIntoTensor, AllgatherSdma, AllreduceSdma, DataType, size_of

    n = 333
    xs = [rank_input(5, r, n, torch.bfloat16) for r in range(world)]
    want = rank_order_sum(xs)
    # async: start, unrelated work, wait
    ar = mori.ccl.AllreduceSdma(rank, world, input_buffer_size=n * 2, output_buffer_size=n * 2, dtype=torch.bfloat16)
    out = torch.zeros(n, dtype=torch.bfloat16)
    assert ar.start_async(xs[rank], out, n) is True and ar.is_async_in_progress()
    _ = torch.randn(64, 64) @ torch.randn(64, 64)
    waited = ar.wait_async()
    if not (isinstance(waited, float) and waited >= 0 and not ar.is_async_in_progress()):
        failures.append(f"wait_async returned {waited!r} / still in progress")
    if not torch.equal(out, want):
        failures.append("async all-reduce differs from the rank-order sum")
    with pytest.raises(RuntimeError, match="wait_async without a start_async"):
        ar.wait_async()
    # in place
    data = xs[rank].clone()
    ar.allreduce_inplace(data, n)
    if not torch.equal(data, want):
        failures.append("allreduce_inplace differs")
    data = xs[rank].clone()
    ar(data, data, n)
    if not torch.equal(data, want):
        failures.append("all-reduce with input == output differs")
    with pytest.raises(RuntimeError, match="copy_output_to_user=True"):
        ar.get_output_transit_buffer()
    # copy_output_to_user=False: results in the transit buffer, output untouched
    art = AllreduceSdma(rank, world, input_buffer_size=n * 2, output_buffer_size=n * 2, copy_output_to_user=False,
                        dtype=torch.bfloat16)
    untouched = torch.full((n,), 3.0, dtype=torch.bfloat16)
    art(xs[rank], untouched, n)
    if not (torch.equal(art.get_output_transit_buffer()[:n], want) and bool((untouched == 3).all())):
        failures.append("copy_output_to_user=False: transit buffer / output wrong")
    # in-place all-gather (input = this rank's chunk of the output)
    ag = AllgatherSdma(rank, world, input_buffer_size=n * 2)
    buf = torch.zeros(world * n, dtype=torch.bfloat16)
    buf[rank * n : (rank + 1) * n] = xs[rank]
    ag(buf[rank * n : (rank + 1) * n], buf, n)
    if not torch.equal(buf, torch.cat(xs)):
        failures.append("in-place all-gather differs")
    # AllGatherIntoTensor with a DataType
    agit = AllGatherIntoTensor(my_pe=rank, npes=world, input_buffer_size=n * 8, output_buffer_size=n * 8 * world)
    for dt, tdt in ((DataType.BFloat16, torch.bfloat16), (DataType.Int8, torch.int8), (DataType.Float64, torch.float64)):
        if size_of(dt) != torch.empty((), dtype=tdt).element_size():
            failures.append(f"size_of({dt!r}) wrong")
        src = (torch.arange(n) % 50 + rank * 3).to(tdt)
        dst = torch.zeros(world * n, dtype=tdt)
        agit(src, dst, n, dt)
        ref = torch.cat([(torch.arange(n) % 50 + r * 3).to(tdt) for r in range(world)])
        if not torch.equal(dst, ref):
            failures.append(f"AllGatherIntoTensor {dt!r} differs")
        dst.zero_()
        assert agit.start_async(src, dst, n, dt)
        agit.wait_async()
        if not torch.equal(dst, ref):
            failures.append(f"AllGatherIntoTensor async {dt!r} differs")
    for name in ("HierAllGather", "IntraNodeSubGroupAllgatherSdma"):
        with pytest.raises(ImportError, match="not provided by mori-suite"):
            getattr(mori.ccl, name)
    for h in (ar, art, ag, agit):
        h.close()


def _bad_input(rank: int, world: int, failures: list[str]) -> None:
    from mori_core.ccl import All2allSdma, AllreduceSdma

    n = 64
    ar = AllreduceSdma(rank, world, input_buffer_size=n * 2, output_buffer_size=n * 2, dtype=torch.bfloat16)
    x = torch.ones(4 * n, dtype=torch.bfloat16)
    out = torch.zeros(4 * n, dtype=torch.bfloat16)
    cases = [
        (lambda: ar(x, out, n + 1), ValueError, r"count=65 is 130 bytes of input per rank, more than input_buffer_size=128"),
        (lambda: ar(x.float(), out.float(), 8), ValueError, r"input_data has dtype torch.float32; .*dtype=torch.bfloat16"),
        (lambda: ar(x, out.half(), 8), ValueError, r"output_data has dtype torch.float16"),
        (lambda: ar(x.to("meta"), out, 8), ValueError, r"input_data is on meta.*works on cpu"),
        (lambda: ar(x[::2], out, 8), ValueError, r"input_data must be contiguous"),
        (lambda: ar(x, out[:4], 8), ValueError, r"count=8 needs 8 elements of output_data, it has 4"),
        (lambda: ar(x, out, -1), ValueError, r"count must be a non-negative int"),
        (lambda: ar(x, x[1:], 8), ValueError, r"input_data and output_data overlap"),
        (lambda: ar([1, 2], out, 1), TypeError, r"input_data must be a torch.Tensor"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn()
    a2a = All2allSdma(rank, world, input_buffer_size=world * n * 4, output_buffer_size=world * n * 4)
    y = torch.zeros(2 * world * n, dtype=torch.int32)
    with pytest.raises(ValueError, match="all-to-all needs separate input and output"):
        a2a(y, y[1:], n)
    # nothing was lost: the same handles still work
    want = torch.full((n,), float(world), dtype=torch.bfloat16)
    ar(x, out, n)
    if not torch.equal(out[:n], want):
        failures.append("all-reduce after refused calls differs")
    for args, pattern in (((rank, world + 1), "differ from the process group"), ((world, world), r"my_pe=\d+ must be in")):
        with pytest.raises(ValueError, match=pattern):
            AllreduceSdma(*args, input_buffer_size=64, output_buffer_size=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Unsupported dtype torch.float64"):
        AllreduceSdma(rank, world, dtype=torch.float64)
    ar.close()
    a2a.close()


def _suite(rank: int, world: int) -> None:
    failures: list[str] = []
    for part in (_collectives, _modes, _bad_input):
        part(rank, world, failures)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_cpu_reference(world: int) -> None:
    run_ranks(_suite, world, backend="gloo", timeout=240, env={"CUDA_VISIBLE_DEVICES": ""})


def test_options_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    from mori_core.ccl.options import NEVER_BYTES, CclOptions, parse_bytes

    monkeypatch.setenv("MORI_CCL_ENGINE", "sdma")
    monkeypatch.setenv("MORI_CCL_CE_MIN_BYTES", "2M")
    o = CclOptions.resolve(sm_blocks=16)
    assert (o.engine, o.engine_code, o.ce_min_bytes, o.sm_blocks) == ("ce", 1, 2 << 20, 16)
    assert CclOptions.resolve(engine="sm").engine == "sm"  # a keyword beats the variable
    monkeypatch.setenv("MORI_CCL_ENGINE", "gpu")
    with pytest.raises(ValueError, match=r"MORI_CCL_ENGINE='gpu' must be one of"):
        CclOptions.resolve()
    monkeypatch.delenv("MORI_CCL_ENGINE")
    with pytest.raises(ValueError, match=r"sm_blocks=129 must be in \[0, 128\]"):
        CclOptions.resolve(sm_blocks=129)
    with pytest.raises(ValueError, match=r"ce_split=9 must be in \[0, 8\]"):
        CclOptions.resolve(ce_split=9)
    monkeypatch.setenv("MORI_CCL_AR_CE_MIN_BYTES", "off")
    d = CclOptions.resolve()
    assert d.ar_ce_min_bytes == parse_bytes("never", "x") == NEVER_BYTES
    assert (d.blocks_for("allreduce"), d.blocks_for("allgather"), o.blocks_for("allgather")) == (128, 64, 16)
    # copies in flight per peer: one for the all-to-all, two otherwise, unless given
    assert (d.split_for("all2all"), d.split_for("allgather"), d.split_for("allreduce")) == (1, 2, 2)
    assert CclOptions.resolve(ce_split=3).split_for("all2all") == 3
    monkeypatch.setenv("MORI_CCL_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MORI_CCL_TIMEOUT_S='soon' is not a number of seconds"):
        CclOptions.resolve()
    assert parse_bytes("512K", "x") == 512 << 10 and parse_bytes("1MiB", "x") == 1 << 20
    with pytest.raises(ValueError, match="x='lots' is not a size"):
        parse_bytes("lots", "x")


def test_without_process_group_says_what_to_do() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the GPU engines are used, not the CPU reference")
    from mori_core.ccl import AllgatherSdma

    with pytest.raises(RuntimeError, match="init_process_group"):
        AllgatherSdma(0, 2, input_buffer_size=64)
