"""Many-piece batches for ``bench io --pieces`` (XGMI, GPU memory): what a KV request looks like.

A 2,048-token request of a 32-layer model with 8 KV heads of 128 (bf16, pages of 16 tokens)
is 8,192 pieces of 32 KiB when SGLang keeps K and V of every layer in buffers of their own
and the pages are scattered. Each row here is one batch of ``count`` pieces of ``size``
bytes at random, never adjacent offsets (so nothing merges), moved by

* one session ``batch_write`` (one region pair);
* one engine ``batch_write`` over 64 region pairs (the same buffers registered as 64 slices,
  ``count / 64`` pieces each: the per-layer K/V shape);

next to baselines of the same pieces between the same two GPUs, in the same run and
process: copy engines (one ``cudaMemcpyAsync`` per piece; one ``cudaMemcpyBatchAsync``),
one contiguous ``Tensor.copy_`` of the same bytes, and the scatter kernel alone (GPU time
in a CUDA graph). Latency is eager: from the call until completion was seen, iterations
back to back; "host" is the time inside the call.

``--xgmi-sweep`` repeats the engine rows with other engine settings (``MORI_IO_XGMI_*``, the
copy proxy's ``MORI_IO_XGMI_PROXY_BLOCKS`` included; read when a backend is created: each setting
gets a fresh initiator engine in this process). Tables print as soon as they are measured.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mori_core.bench.table import fmt_bytes, median, print_table

SLICES = 64  # region pairs of the multi-pair row (a 32-layer model's K and V buffers)

# Kernel settings the sweep tries (environment of the XGMI backend); "" = the defaults.
SWEEP = [
    "",
    "MORI_IO_XGMI_MAX_BLOCKS=132",
    "MORI_IO_XGMI_MAX_BLOCKS=264",
    "MORI_IO_XGMI_MAX_BLOCKS=528",
    "MORI_IO_XGMI_BLOCK_THREADS=512",
    "MORI_IO_XGMI_PIECE_BYTES=32K",
    "MORI_IO_XGMI_PIECE_BYTES=64K,MORI_IO_XGMI_BLOCK_THREADS=512",
    "MORI_IO_XGMI_PIECE_BYTES=32K,MORI_IO_XGMI_BLOCK_THREADS=512,MORI_IO_XGMI_MAX_BLOCKS=264",
    "MORI_IO_XGMI_KERNEL_MAX_AVG_BYTES=16K",
]


def parse(text: str, parse_size: Callable[[str], int]) -> List[Tuple[int, int]]:
    """``"8192x32K,64x8K"`` -> [(8192, 32768), (64, 8192)]."""
    rows = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        count, _, size = part.partition("x")
        if not size or int(count) < 1:
            raise SystemExit(f"--pieces: {part!r} is not COUNTxSIZE (e.g. 8192x32K)")
        rows.append((int(count), parse_size(size)))
    return rows


def span(rows: Sequence[Tuple[int, int]]) -> int:
    """Bytes each side's buffer needs (pieces sit in every other slot of their size)."""
    return max((2 * count * size for count, size in rows), default=0)


def layout(count: int, size: int, seed: int, slices: int = 1) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Offsets of ``count`` pieces in ``slices`` equal slices of a buffer: local piece ``i`` of a slice
    at slot ``2 i``, remote at slot ``2 p(i)`` of a random permutation ``p`` (never adjacent, random order).
    Offsets are relative to their slice; arrays are ``[slices, count / slices]``."""
    per = count // slices
    rng = np.random.default_rng(seed)
    local = np.tile(np.arange(per, dtype=np.int64) * 2 * size, (slices, 1))
    remote = np.stack([rng.permutation(per).astype(np.int64) * 2 * size for _ in range(slices)])
    return local, remote, np.full((slices, per), size, dtype=np.int64)


def _timed(call: Callable[[], Any], wait: Callable[[Any], None], iters: int, warmup: int) -> Tuple[List[float], List[float]]:
    """(latency us, host us) of ``iters`` calls: the call, then its wait, back to back."""
    pc = time.perf_counter_ns
    lat, host = [], []
    for i in range(warmup + iters):
        t0 = pc()
        handle = call()
        t1 = pc()
        wait(handle)
        t2 = pc()
        if i >= warmup:
            lat.append((t2 - t0) / 1e3)
            host.append((t1 - t0) / 1e3)
    return lat, host


def _statuses_ok(statuses: Any) -> None:
    from mori_core.io import StatusCode, wait_all

    sts = statuses if isinstance(statuses, list) else [statuses]
    code = wait_all(sts, 60_000)
    if code != StatusCode.SUCCESS:
        bad = next((s for s in sts if not s.Succeeded()), None)
        raise RuntimeError(f"transfer failed: {code} {bad.Message() if bad else ''}")


class Setup:
    """Everything the rows need on the initiator: engine, session, local slices, the target's descriptors."""

    def __init__(self, engine: Any, session: Any, lm: Any, local_slices: List[Any], remote: Any,
                 remote_slices: List[Any]) -> None:
        self.engine, self.session, self.lm, self.remote = engine, session, lm, remote
        self.local_slices, self.remote_slices = local_slices, remote_slices


def slice_descs(engine: Any, ptr: int, nbytes: int, device: int) -> List[Any]:
    """The buffer at ``ptr`` registered again as ``SLICES`` equal regions."""
    from mori_core.io import MemoryLocationType

    step = nbytes // SLICES
    return [engine.register_memory(ptr + k * step, step, device, MemoryLocationType.GPU) for k in range(SLICES)]


def engine_rows(s: Setup, rows: Sequence[Tuple[int, int]], iters: int, warmup: int) -> Dict[Tuple[int, int], Dict]:
    """Session and 64-pair engine batch_write of every row: latency and host us lists."""
    out = {}
    for count, size in rows:
        lo, ro, sz = layout(count, size, seed=count)
        lo1, ro1, sz1 = lo.ravel(), ro.ravel(), sz.ravel()
        sess = s.session

        def session_call() -> Any:
            return sess.batch_write(lo1, ro1, sz1, sess.allocate_transfer_uid())

        r: Dict[str, Any] = {}
        r["session"] = _timed(session_call, _statuses_ok, iters, warmup)
        if count % SLICES == 0 and s.local_slices:
            lo64, ro64, sz64 = layout(count, size, seed=count + 1, slices=SLICES)
            eng = s.engine

            def multi_call() -> Any:
                uids = [eng.allocate_transfer_uid() for _ in range(SLICES)]
                return eng.batch_write(s.local_slices, list(lo64), s.remote_slices, list(ro64), list(sz64), uids)

            r["pairs"] = _timed(multi_call, _statuses_ok, iters, warmup)
        out[(count, size)] = r
    return out


def breakdowns(s: Setup, rows: Sequence[Tuple[int, int]], iters: int, warmup: int) -> List[Tuple[str, Dict]]:
    """Where the host time of one session batch_write of each row goes (``io_cost``)."""
    from mori_core.bench.io_cost import breakdown

    out = []
    for count, size in rows:
        lo, ro, sz = (a.ravel() for a in layout(count, size, seed=count))
        pieces = breakdown(lambda uid: s.session.batch_write(lo, ro, sz, uid), s.session.allocate_transfer_uid,
                           iters, warmup)
        out.append((f"{count} x {fmt_bytes(size)}", pieces))
    return out


def baselines(rows: Sequence[Tuple[int, int]], src_dev: int, dst_dev: int, iters: int, warmup: int) -> Dict:
    """Copy engines per piece, cudaMemcpyBatchAsync, a contiguous copy_ and the scatter kernel alone."""
    import torch

    from mori_core import _C
    from mori_core.bench.io_xgmi import KernelTimer, copy_baseline

    nbytes = span(rows)
    timer = KernelTimer(src_dev, dst_dev, nbytes)
    testing = _C._xgmi_testing
    out: Dict[Tuple[int, int], Dict[str, Any]] = {}
    with torch.cuda.device(src_dev):
        # A stream of its own: cudaMemcpyBatchAsync refuses the legacy default stream (the
        # current stream here), which is why this column was empty before.
        stream = torch.cuda.Stream()
        for count, size in rows:
            lo, ro, sz = (a.ravel().tolist() for a in layout(count, size, seed=count))
            srcs = [timer.src.data_ptr() + o for o in lo]
            dsts = [timer.dst.data_ptr() + o for o in ro]
            r: Dict[str, Any] = {}
            for name, batched in (("ce_pieces", False), ("ce_batch", True)):

                def call(batched: bool = batched) -> Any:
                    testing.copy_engine_pieces(dsts, srcs, sz, stream.cuda_stream, batched)

                try:
                    r[name] = _timed(call, lambda _: stream.synchronize(), iters, warmup)
                except Exception as e:  # e.g. a runtime without cudaMemcpyBatchAsync
                    r[name] = None
                    r[name + "_error"] = f"{type(e).__name__}: {e}"
            r["copy"] = copy_baseline(count * size, src_dev, dst_dev, iters, warmup)
            r["kernel"] = timer.kernel_segments(dsts, srcs, sz)
            out[(count, size)] = r
    return out


def sweep(make: Callable[[str], Setup], close: Callable[[Setup], None], rows: Sequence[Tuple[int, int]],
          settings: Sequence[str], iters: int, warmup: int, src_dev: int, dst_dev: int) -> List[List[Any]]:
    """Rows' session / 64-pair latencies under each kernel setting (a fresh engine each), plus the
    kernel alone in that shape for the largest row."""
    from mori_core.bench.io_xgmi import KernelTimer

    big = max(rows, key=lambda r: r[0] * r[1])
    timer = KernelTimer(src_dev, dst_dev, span([big]))
    lo, ro, sz = (a.ravel().tolist() for a in layout(big[0], big[1], seed=big[0]))
    srcs = [timer.src.data_ptr() + o for o in lo]
    dsts = [timer.dst.data_ptr() + o for o in ro]
    table = []
    for setting in settings:
        env = dict(kv.split("=", 1) for kv in setting.split(",") if kv)
        s = make(setting)
        try:
            res = engine_rows(s, rows, iters, warmup)
        finally:
            close(s)
        row: List[Any] = [setting or "defaults"]
        for r in rows:
            row.append(median(res[r]["session"][0]))
            row.append(median(res[r]["pairs"][0]) if "pairs" in res[r] else "-")
        shape = _shape_of(env)
        k = timer.kernel_segments(dsts, srcs, sz, *shape)
        row.append(k["gpu_us"] or 0.0)
        table.append(row)
        print(f"[io --pieces] sweep: {setting or 'defaults'} done", file=sys.stderr, flush=True)
    return table


def _shape_of(env: Dict[str, str]) -> Tuple[int, int, int]:
    def size(v: str) -> int:
        v = v.strip().upper()
        return int(v[:-1]) * {"K": 1 << 10, "M": 1 << 20}[v[-1]] if v[-1] in "KM" else int(v)

    return (size(env.get("MORI_IO_XGMI_PIECE_BYTES", "16K")), int(env.get("MORI_IO_XGMI_BLOCK_THREADS", 256)),
            int(env.get("MORI_IO_XGMI_MAX_BLOCKS", 0)))


class EnvSetting:
    """``with EnvSetting("A=1,B=2"):`` sets those variables and restores the previous values after."""

    def __init__(self, setting: str) -> None:
        self.env = dict(kv.split("=", 1) for kv in setting.split(",") if kv)
        self.saved: Dict[str, Optional[str]] = {}

    def __enter__(self) -> "EnvSetting":
        for k, v in self.env.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v
        return self

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def report_breakdown(breakdown_rows: List[Tuple[str, Dict]]) -> None:
    """Where the host time of one session batch_write goes, per row."""
    from mori_core.bench.io_cost import PIECES

    print_table("many-piece session batch_write: where one call goes (us, median)",
                ["batch"] + list(PIECES), [[what] + [p[k] for k in PIECES] for what, p in breakdown_rows],
                "read args: offsets/sizes into C++ (numpy arrays); validate: bounds, merge, status; backend: "
                "submit incl. the descriptor upload and launch ('of which launch'); completion: from the call's "
                "return until Wait saw SUCCESS.")
    sys.stdout.flush()


def report_sweep(rows: Sequence[Tuple[int, int]], sweep_rows: List[List[Any]]) -> None:
    """The rows' latencies under each engine setting."""
    hdr = ["engine setting"]
    for count, size in rows:
        hdr += [f"{count} x {fmt_bytes(size)} session us", f"{count} x {fmt_bytes(size)} 64 pairs us"]
    big = max(rows, key=lambda r: r[0] * r[1])
    hdr.append(f"kernel alone, {big[0]} x {fmt_bytes(big[1])}, GPU us")
    print_table("many-piece batches under other engine settings (latency us, median; one engine per setting)",
                hdr, sweep_rows)
    sys.stdout.flush()


def report_summary(rows: Sequence[Tuple[int, int]], eng: Dict, base: Dict, where: str) -> None:
    """The many-piece summary: engine rows beside their same-run baselines."""
    out = []
    for count, size in rows:
        nbytes = count * size
        e, b = eng[(count, size)], base[(count, size)]
        lat, host = median(e["session"][0]), median(e["session"][1])
        pairs = median(e["pairs"][0]) if "pairs" in e else None
        copy = median(b["copy"][0])
        ce = median(b["ce_pieces"][0]) if b.get("ce_pieces") else None
        ceb = median(b["ce_batch"][0]) if b.get("ce_batch") else None
        kern = b["kernel"]["gpu_us"]
        out.append([f"{count} x {fmt_bytes(size)}", lat, host, nbytes / lat / 1e3,
                    "-" if pairs is None else pairs, "-" if pairs is None else nbytes / pairs / 1e3,
                    "-" if ce is None else ce, "-" if ceb is None else ceb, copy, kern or 0.0, lat / copy])
        for key in ("ce_pieces_error", "ce_batch_error"):
            if key in b:
                print(f"({count} x {fmt_bytes(size)}: {key[:-6]} unavailable: {b[key]})")
    print_table(f"summary: many-piece batches, {where} (latency = call to completion seen, eager, median us)",
                ["batch", "session batch_write us", "host us", "GB/s", f"{SLICES} region pairs, one batch_write us",
                 "GB/s (pairs)", "copy engines, per piece us", "cudaMemcpyBatchAsync us", "one contiguous copy_ us",
                 "kernel alone GPU us", "session / copy_"], out,
                "pieces at random, never adjacent offsets (nothing merges); baselines moved the same pieces between "
                "the same GPUs in this process (contiguous copy_: the same bytes in one piece, the floor).")
    sys.stdout.flush()
