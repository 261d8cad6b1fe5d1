"""``python -m mori_core.bench io``: MORI-IO's benchmark matrix between two local processes.

Modes follow MORI's benchmark: {single, batch} x {engine, session} for read and
write. "single" submits ``batch`` separate transfers and waits for all of them;
"batch" submits one batched transfer of ``batch`` scattered segments. Every
latency is the median over iterations of the wall time from the first submit to
the last completion, measured on the initiator (eager: iterations back to back).
Beside it, the host time per call: the time spent inside the transfer call
itself (until it returns the status), measured separately from completion.

A baseline measured in the same run sits beside it: a raw TCP socket for the
TCP backend, a plain copy-engine peer copy (torch ``Tensor.copy_``) for the
XGMI backend. ``--breakdown`` adds where the host time of one call goes
(timestamps taken inside the core, see ``mori_core._C.io_profile``); for XGMI
also the scatter kernel's GPU time alone and a copy-engine copy of the same
bytes; ``--kernel-sweep`` times the scatter kernel's shapes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from mori_core.bench.table import fmt_bytes, median, print_table
from mori_core.io import StatusCode, wait_all

MODES = ("single", "single+session", "batch", "batch+session")


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the IO benchmark."""
    p.add_argument("--backend", choices=("tcp", "xgmi"), default="tcp", help="transport to measure (default tcp)")
    p.add_argument("--mem", choices=("cpu", "gpu"), default=None, help="memory type (default: cpu for tcp, gpu for xgmi)")
    p.add_argument("--op", choices=("write", "read", "both"), default="both")
    p.add_argument("--sizes", default="8K,64K,1M", help="comma-separated message sizes (default 8K,64K,1M)")
    p.add_argument("--sweep", action="store_true", help="sweep message sizes 4K..64M (doubling)")
    p.add_argument("--batch", type=int, default=64, help="transfers (segments) per iteration (default 64)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--large", default="256M", help="size of the single large transfer compared with the baseline ('' to skip)")
    p.add_argument("--large-iters", type=int, default=8)
    p.add_argument("--num-connections", type=int, default=4, help="TCP sockets per peer")
    p.add_argument("--xgmi-streams", type=int, default=64, help="XgmiBackendConfig.num_streams (default 64)")
    p.add_argument("--xgmi-proxy-blocks", type=int, default=0,
                   help="XgmiBackendConfig.proxy_blocks: a resident copy kernel of N blocks takes transfers of at "
                        "most 64 segments and --xgmi-proxy-max-bytes (default 0 = off: one launch per transfer)")
    p.add_argument("--xgmi-proxy-max-bytes", default="1M", help="XgmiBackendConfig.proxy_max_bytes (default 1M)")
    p.add_argument("--initiator-device", type=int, default=0)
    p.add_argument("--target-device", type=int, default=1)
    p.add_argument("--arrays", choices=("list", "numpy"), default="list",
                   help="pass offsets/sizes of batches as Python lists (default) or numpy int64 arrays")
    p.add_argument("--breakdown", action="store_true",
                   help="time the pieces of one batch call (conversion, validation, launch, completion)")
    p.add_argument("--kernel-sweep", action="store_true", help="XGMI: time the scatter kernel's shapes alone")
    p.add_argument("--pieces", default="",
                   help="XGMI: many-piece batches COUNTxSIZE,... (e.g. 8192x32K,64x8K,64x128K) at scattered offsets, "
                        "beside copy-engine baselines of the same pieces ('' = none; --sizes '' skips the matrix)")
    p.add_argument("--xgmi-sweep", nargs="?", const="all", default=None, metavar="SETTINGS",
                   help="XGMI --pieces: repeat the many-piece rows under other engine settings (MORI_IO_XGMI_*): "
                        "the built-in list, or SETTINGS as 'A=1,B=2;C=3' (one setting per ';', the defaults first)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG chart of bandwidth vs message size")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ----------------------------------------------------------------- target side
class _Buffer:
    """A benchmark buffer: numpy for CPU memory (no torch needed), torch for GPU."""

    def __init__(self, nbytes: int, mem: str, device: int) -> None:
        self.mem = mem
        if mem == "gpu":
            import torch

            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        else:
            import numpy as np

            self.array = np.zeros(nbytes, dtype=np.uint8)

    def register(self, engine):
        from mori_core.io import MemoryLocationType

        if self.mem == "gpu":
            return engine.register_torch_tensor(self.tensor)
        return engine.register_memory(self.array.ctypes.data, self.array.nbytes, -1, MemoryLocationType.CPU)

    def randomize(self) -> None:
        if self.mem == "gpu":
            self.tensor.random_(0, 255)
        else:
            import numpy as np

            self.array[:] = np.random.default_rng(0).integers(0, 256, self.array.size, dtype=np.uint8)


def _make_engine(key: str, backend: str, num_connections: int, xgmi_streams: int = 64, proxy_blocks: int = 0,
                 proxy_max_bytes: int = 1 << 20):
    from mori_core.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig, XgmiBackendConfig

    # A TCP measurement must stay on TCP even for GPU memory on one node.
    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0, enable_auto_xgmi=backend == "xgmi"))
    if backend == "tcp":
        engine.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=num_connections))
    else:
        # Like MORI's benchmark: no target notifications in the timed loop.
        engine.create_backend(BackendType.XGMI, XgmiBackendConfig(
            num_streams=xgmi_streams, enable_notification=False, proxy_blocks=proxy_blocks,
            proxy_max_bytes=proxy_max_bytes))
    return engine


def _raw_sink(listener: socket.socket, stop: threading.Event) -> None:
    """Baseline peer: receive a length-prefixed payload into a buffer, ack with one byte."""
    listener.settimeout(0.5)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = None
            while True:
                hdr = conn.recv(8, socket.MSG_WAITALL)
                if len(hdr) < 8:
                    break
                n = int.from_bytes(hdr, "little")
                if buf is None or len(buf) < n:
                    buf = bytearray(n)
                view, got = memoryview(buf), 0
                while got < n:
                    r = conn.recv_into(view[got:n])
                    if r == 0:
                        return
                    got += r
                conn.sendall(b"k")


def _target_main(pipe, backend: str, mem: str, device: int, nbytes: int, num_connections: int,
                 slices: bool = False) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(90, exit=False)  # says where it is stuck if it ever is
    engine = _make_engine("bench-target", backend, num_connections)
    buf = _Buffer(nbytes, mem, device)
    md = buf.register(engine)
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen(4)
    stop = threading.Event()
    threading.Thread(target=_raw_sink, args=(raw, stop), daemon=True).start()
    parts = []
    if slices:  # the many-piece rows' 64 region pairs
        from mori_core.bench.io_pieces import slice_descs

        parts = slice_descs(engine, buf.tensor.data_ptr(), nbytes, device)
    pipe.send((engine.get_engine_desc().pack(), md.pack(), raw.getsockname()[1], [d.pack() for d in parts]))
    faulthandler.cancel_dump_traceback_later()
    from mori_core.io import EngineDesc

    engine.register_remote_engine(EngineDesc.unpack(pipe.recv()))
    pipe.recv()  # "stop"
    stop.set()
    engine.deregister_memory(md)


# -------------------------------------------------------------- initiator side
@dataclass
class Result:
    op: str
    mode: str
    msg: int
    batch: int
    lat_us: float  # median per iteration
    min_us: float
    host_us: float  # median host time per transfer call

    @property
    def gbps(self) -> float:
        return self.msg * self.batch / (self.lat_us * 1e-6) / 1e9


def _time(fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Wall time (us) of each of ``iters`` calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _time_host(fn: Callable[[], tuple[float, float]], iters: int, warmup: int) -> tuple[list[float], list[float]]:
    """Runs an iteration that times itself, returning (latency ns, host ns per call): (latency us, host us) lists.

    The iteration stamps right before its first transfer call and right after its
    wait returned, so the harness (uid allocation, result checks) is not counted.
    """
    for _ in range(warmup):
        fn()
    wall, host = [], []
    for _ in range(iters):
        lat, h = fn()
        wall.append(lat / 1e3)
        host.append(h / 1e3)
    return wall, host


def _expect(code, statuses) -> None:
    if code != StatusCode.SUCCESS:
        bad = next((s for s in statuses if not s.Succeeded()), None)
        raise RuntimeError(f"transfer failed: {code} {bad.Message() if bad else ''}")


def offsets_of(msg: int, batch: int, arrays: str):
    """Scattered offsets (stride 2 x msg: never merged) and sizes, as lists or numpy arrays."""
    offs = [i * 2 * msg for i in range(batch)]
    sizes = [msg] * batch
    if arrays == "numpy":
        import numpy as np

        return np.asarray(offs, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    return offs, sizes


def _runner(engine, session, lm, rm, op: str, mode: str, msg: int, batch: int,
            arrays: str = "list") -> Callable[[], tuple[float, float]]:
    """One iteration of a mode; returns (ns from the first call until the wait returned, host ns per call)."""
    offs, sizes = offsets_of(msg, batch, arrays)
    single_offs = [i * 2 * msg for i in range(batch)]
    read = op == "read"
    pc = time.perf_counter_ns
    if mode in ("single", "single+session"):
        if mode == "single":
            f = engine.read if read else engine.write
            call = lambda o, uid: f(lm, o, rm, o, msg, uid)  # noqa: E731
        else:
            f = session.read if read else session.write
            call = lambda o, uid: f(o, o, msg, uid)  # noqa: E731
        alloc = engine.allocate_transfer_uid

        def single() -> tuple[float, float]:
            uids = [alloc() for _ in single_offs]
            sts, host = [], 0
            start = pc()
            for o, uid in zip(single_offs, uids):
                t0 = pc()
                sts.append(call(o, uid))
                host += pc() - t0
            code = wait_all(sts, 60_000)
            end = pc()
            _expect(code, sts)
            return end - start, host / len(single_offs)

        return single
    if mode == "batch":
        f = engine.batch_read if read else engine.batch_write

        def engine_batch() -> tuple[float, float]:
            uid = engine.allocate_transfer_uid()
            t0 = pc()
            sts = f([lm], [offs], [rm], [offs], [sizes], [uid])
            t1 = pc()
            code = wait_all(sts, 60_000)
            t2 = pc()
            _expect(code, sts)
            return t2 - t0, t1 - t0

        return engine_batch
    f = session.batch_read if read else session.batch_write

    def session_batch() -> tuple[float, float]:
        uid = session.allocate_transfer_uid()
        t0 = pc()
        st = f(offs, offs, sizes, uid)
        t1 = pc()
        code = st.WaitFor(60_000)
        t2 = pc()
        _expect(code, [st])
        return t2 - t0, t1 - t0

    return session_batch


def _lone_write(session, msg: int) -> Callable[[], tuple[float, float]]:
    """One session write, waited for before the next: (ns until the wait returned, host ns of the call)."""
    pc = time.perf_counter_ns

    def once() -> tuple[float, float]:
        uid = session.allocate_transfer_uid()
        t0 = pc()
        st = session.write(0, 0, msg, uid)
        t1 = pc()
        code = st.WaitFor(60_000)
        t2 = pc()
        _expect(code, [st])
        return t2 - t0, t1 - t0

    return once


def _raw_baseline(port: int, nbytes: int, iters: int, warmup: int) -> list[float]:
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20) if nbytes >= (1 << 20) else bytearray(nbytes))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def once() -> None:
            s.sendall(len(payload).to_bytes(8, "little"))
            s.sendall(payload)
            if s.recv(1) != b"k":
                raise RuntimeError("raw baseline peer closed")

        return _time(once, iters, warmup)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="io bench", unit="case", file=sys.stderr, leave=False)
    except ImportError:
        return None


def run(args: argparse.Namespace) -> int:
    """Run the matrix and print the tables; returns 0 on success."""
    mem = args.mem or ("cpu" if args.backend == "tcp" else "gpu")
    sizes = [1 << s for s in range(12, 27)] if args.sweep else [_parse_size(s) for s in args.sizes.split(",") if s]
    large = _parse_size(args.large) if args.large else 0
    ops = ("write", "read") if args.op == "both" else (args.op,)
    if args.batch < 1 or args.iters < 1:
        raise SystemExit("--batch and --iters must be >= 1")
    xgmi_gpu = args.backend == "xgmi" and mem == "gpu"
    from mori_core.bench import io_pieces

    pieces = io_pieces.parse(args.pieces, _parse_size) if xgmi_gpu else []
    nbytes = max([s * 2 * args.batch for s in sizes] + [large, io_pieces.span(pieces), 1])

    from mori_core.io import EngineDesc, MemoryDesc

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target_main, args=(child, args.backend, mem, args.target_device, nbytes,
                                                  args.num_connections, bool(pieces)), daemon=True)
    proc.start()
    child.close()  # so a dying target shows up as EOF on the pipe
    extra: dict = {}
    try:
        for _ in range(180):
            if parent.poll(1) or not proc.is_alive():
                break
        if not proc.is_alive():
            raise RuntimeError(f"target process exited with code {proc.exitcode} before it was ready")
        if not parent.poll(0):
            raise RuntimeError("target process did not start within 180 s")
        tdesc, tmem, raw_port, tslices = parent.recv()
        engine = _make_engine("bench-initiator", args.backend, args.num_connections, args.xgmi_streams,
                              args.xgmi_proxy_blocks, _parse_size(args.xgmi_proxy_max_bytes))
        parent.send(engine.get_engine_desc().pack())
        engine.register_remote_engine(EngineDesc.unpack(tdesc))
        rm = MemoryDesc.unpack(tmem)
        buf = _Buffer(nbytes, mem, args.initiator_device)
        buf.randomize()
        lm = buf.register(engine)
        session = engine.create_session(lm, rm)
        if session is None:
            raise RuntimeError(f"no backend can serve this pair: {engine.explain_route(lm, rm)}")
        route = engine.route_of(lm, rm)

        results: list[Result] = []
        bar = _progress(len(ops) * len(MODES) * len(sizes), not args.no_progress)
        for op in ops:
            for msg in sizes:
                for mode in MODES:
                    fn = _runner(engine, session, lm, rm, op, mode, msg, args.batch, args.arrays)
                    lat, host = _time_host(fn, args.iters, args.warmup)
                    results.append(Result(op, mode, msg, args.batch, median(lat), min(lat), median(host)))
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()

        # One transfer alone: submit, wait, repeat (the latency of a lone small write).
        if sizes:
            lone = sizes[0]
            extra["lone"] = (lone, *_time_host(_lone_write(session, lone), max(args.iters, 50), args.warmup))
        if pieces:
            _pieces(args, pieces, engine, session, lm, buf, rm, [MemoryDesc.unpack(d) for d in tslices], tdesc, nbytes,
                    f"GPU {args.initiator_device} -> GPU {args.target_device}, {_hardware(mem)}")
        if args.breakdown and sizes:
            extra["breakdown"] = _breakdowns(session, sizes, args, nbytes)
        if xgmi_gpu and sizes and (args.breakdown or args.kernel_sweep):
            extra.update(_gpu_facts(sizes, args))

        large_rows = []
        if large:
            lat = _time_host(_runner(engine, session, lm, rm, "write", "batch+session", large, 1), args.large_iters, 2)[0]
            if args.backend == "tcp":
                base = _raw_baseline(raw_port, large, args.large_iters, 2)
            else:
                from mori_core.bench.io_xgmi import copy_baseline

                base = copy_baseline(large, args.initiator_device, args.target_device, args.large_iters, 2)[0]
            bw, bbw = large / median(lat) / 1e3, large / median(base) / 1e3
            large_rows.append([fmt_bytes(large), f"{median(lat):.0f}", f"{bw:.2f}", f"{median(base):.0f}", f"{bbw:.2f}", f"{bw / bbw:.2f}x"])
        parent.send("stop")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()

    if sizes or large_rows:
        _report(args, results, large_rows, mem, str(route).split(".")[-1], sizes, extra)
    if args.plot:
        _plot(args.plot, results, args)
    return 0


def _pieces(args, rows, engine, session, lm, buf, rm, remote_slices, tdesc, nbytes: int, where: str) -> None:
    """The many-piece rows (``io_pieces``), each table printed as soon as it is measured (a run cut
    short by its time limit keeps what it had): the summary with its same-run baselines first, then
    the host-time breakdown, then the engine-setting sweep."""
    from mori_core.bench import io_pieces
    from mori_core.io import EngineDesc

    t0 = time.monotonic()

    def stage(what: str) -> None:
        print(f"[io --pieces] {what}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)

    ptr, dev = buf.tensor.data_ptr(), args.initiator_device
    setup = io_pieces.Setup(engine, session, lm, io_pieces.slice_descs(engine, ptr, nbytes, dev), rm, remote_slices)
    eng = io_pieces.engine_rows(setup, rows, args.iters, args.warmup)
    stage("engine rows")
    base = io_pieces.baselines(rows, dev, args.target_device, args.iters, args.warmup)
    stage("baselines")
    io_pieces.report_summary(rows, eng, base, where)
    if args.breakdown:
        io_pieces.report_breakdown(io_pieces.breakdowns(setup, rows, args.iters, args.warmup))
        stage("breakdown")
    if args.xgmi_sweep is not None:
        settings = io_pieces.SWEEP if args.xgmi_sweep == "all" else [""] + [
            part.strip() for part in args.xgmi_sweep.split(";") if part.strip()]
        made = iter(range(1 << 30))

        def make(setting: str) -> "io_pieces.Setup":
            with io_pieces.EnvSetting(setting):
                e = _make_engine(f"bench-initiator-sweep-{next(made)}", "xgmi", 1, args.xgmi_streams)
            e.register_remote_engine(EngineDesc.unpack(tdesc))
            local = buf.register(e)
            return io_pieces.Setup(e, e.create_session(local, rm), local, io_pieces.slice_descs(e, ptr, nbytes, dev),
                                   rm, remote_slices)

        def close(s: "io_pieces.Setup") -> None:
            for d in [s.lm] + s.local_slices:
                s.engine.deregister_memory(d)

        io_pieces.report_sweep(rows, io_pieces.sweep(make, close, rows, settings, args.iters, args.warmup, dev,
                                                     args.target_device))
        stage("sweep")


def _breakdowns(session, sizes, args, nbytes: int) -> list[tuple[str, str, dict]]:
    """Pieces of one session batch_write per size (lists and numpy arrays), of a 1,024-segment
    batch (how the cost grows with the segment count) and of single writes (8 KiB-ish and 1 byte)."""
    from mori_core.bench.io_cost import breakdown

    out = []
    cases = [(msg, args.batch) for msg in sizes]
    if sizes[0] * 2 * 1024 <= nbytes:
        cases.append((sizes[0], 1024))
    for msg, batch in cases:
        for arrays in ("list", "numpy"):
            offs, lens = offsets_of(msg, batch, arrays)
            pieces = breakdown(lambda uid: session.batch_write(offs, offs, lens, uid), session.allocate_transfer_uid,
                               args.iters, args.warmup)
            out.append((f"{batch} x {fmt_bytes(msg)}", arrays, pieces))
    for msg in (sizes[0], 1):
        one = breakdown(lambda uid: session.write(0, 0, msg, uid), session.allocate_transfer_uid, args.iters,
                        args.warmup)
        out.append((f"1 x {fmt_bytes(msg)}", "single write", one))
    return out


def _gpu_facts(sizes, args) -> dict:
    """XGMI: copy-engine copy of the same bytes, the scatter kernel alone, and (--kernel-sweep) its shapes."""
    from mori_core.bench.io_xgmi import KernelTimer, copy_baseline

    span = max(sizes) * 2 * args.batch
    timer = KernelTimer(args.initiator_device, args.target_device, span)
    from mori_core import _C

    facts: dict = {"ce": {}, "kernel": {}}
    # The floor of any host-fed resident kernel (the copy proxy): one doorbell round trip.
    facts["pingpong"] = median(_C._xgmi_testing.pinned_ping_pong_us(args.initiator_device, 200)[10:])
    for msg in sizes:
        wall, host = copy_baseline(msg * args.batch, args.initiator_device, args.target_device, args.iters, args.warmup)
        facts["ce"][msg] = (median(wall), median(host))
        facts["kernel"][msg] = timer.kernel(msg, args.batch)
    if args.kernel_sweep:
        rows = []
        shapes = [(16384, 256), (16384, 512), (32768, 256), (32768, 512), (65536, 512), (65536, 1024), (131072, 1024)]
        for msg in sizes:
            for piece, threads in shapes:
                k = timer.kernel(msg, args.batch, piece, threads)
                rows.append([f"{args.batch} x {fmt_bytes(msg)}", f"SM kernel, piece {fmt_bytes(piece)}, {threads} threads",
                             k["eager_us"], k["gpu_us"] or 0.0,
                             msg * args.batch / (k["gpu_us"] * 1e3) if k["gpu_us"] else 0.0])
        facts["sweep"] = rows
    return facts


def _hardware(mem: str) -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except Exception:
        pass
    desc = f"{cpu}, {os.cpu_count()} cores"
    if mem == "gpu":
        import torch

        desc += f", {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return desc


def _report(args, results: list[Result], large_rows, mem: str, route: str, sizes, extra: dict) -> None:
    hdr = ["Msg Size", "Batch", "Total"] + [m for m in MODES]
    proxy = (f", copy proxy of {args.xgmi_proxy_blocks} blocks (transfers <= {args.xgmi_proxy_max_bytes}, <= 64 "
             f"segments)" if args.backend == "xgmi" and args.xgmi_proxy_blocks else "")
    note = (f"backend {route}{proxy}, {mem} memory, offsets as {args.arrays}, median of {args.iters} iterations after "
            f"{args.warmup} warm-up; hardware: {_hardware(mem)}")
    for op in sorted({r.op for r in results}, reverse=True):
        rows_bw, rows_lat, rows_host = [], [], []
        for msg in sizes:
            rs = {r.mode: r for r in results if r.op == op and r.msg == msg}
            base = [fmt_bytes(msg), args.batch, fmt_bytes(msg * args.batch)]
            rows_bw.append(base + [rs[m].gbps for m in MODES])
            rows_lat.append(base + [rs[m].lat_us for m in MODES])
            rows_host.append(base + [rs[m].host_us for m in MODES])
        print_table(f"{op}: bandwidth (GB/s, median)", hdr, rows_bw)
        print_table(f"{op}: latency per iteration (us, median, eager)", hdr, rows_lat)
        print_table(f"{op}: host time per transfer call (us, median; single modes: per call of {args.batch})",
                    hdr, rows_host, note)
    if large_rows:
        base_name = "raw socket" if args.backend == "tcp" else "copy-engine peer copy"
        print_table(f"one large write vs {base_name} (same run)",
                    ["Size", "MORI-IO us", "MORI-IO GB/s", f"{base_name} us", f"{base_name} GB/s", "ratio"],
                    large_rows, note)
    if "breakdown" in extra:
        from mori_core.bench.io_cost import PIECES

        rows = [[what, kind] + [p[k] for k in PIECES] for what, kind, p in extra["breakdown"]]
        print_table("where one session write call goes (us, median; session batch_write unless noted)",
                    ["Transfer", "offsets"] + list(PIECES), rows,
                    "to C++: Python wrapper + pybind11 dispatch; read args: offsets/sizes into C++; validate: bounds, "
                    "merge, status; backend: submit incl. the GPU launch API calls ('of which launch'); return: back "
                    "to Python; completion: from the call's return until Wait saw SUCCESS.")
    if "sweep" in extra:
        print_table("scatter kernel shapes, GPU time alone (us, median; same GPUs, this process)",
                    ["Batch", "engine", "eager us (events around each launch)", "GPU us (CUDA graph)", "GB/s (GPU)"],
                    extra["sweep"])
    _summary(args, results, sizes, extra, route)


def _summary(args, results: list[Result], sizes, extra: dict, route: str) -> None:
    """The last table: session writes, latency and host time per call, beside the same run's baselines."""
    rows = []
    for msg in sizes:
        r = next((x for x in results if x.op == "write" and x.mode == "batch+session" and x.msg == msg), None)
        if r is None:
            continue
        row = [f"{args.batch} x {fmt_bytes(msg)}, one batch_write", r.lat_us, r.host_us, r.gbps]
        if "ce" in extra:
            ce = extra["ce"][msg]
            k = extra["kernel"][msg]
            row += [ce[0], k["gpu_us"] or 0.0, r.lat_us - k["gpu_us"] if k["gpu_us"] else 0.0]
        rows.append(row)
    if "lone" in extra:
        lone, lat, host = extra["lone"]
        row = [f"1 x {fmt_bytes(lone)}, one write alone", median(lat), median(host), lone / (median(lat) * 1e3)]
        rows.append(row + ([0.0, 0.0, 0.0] if "ce" in extra else []))
    r = next((x for x in results if x.op == "write" and x.mode == "single+session" and x.msg == sizes[0]), None)
    if r is not None:
        row = [f"{args.batch} x {fmt_bytes(sizes[0])}, {args.batch} writes (per write)", r.lat_us / args.batch,
               r.host_us, r.gbps]
        rows.append(row + ([0.0, 0.0, 0.0] if "ce" in extra else []))
    if "pingpong" in extra:
        rows.append(["pinned-memory round trip host -> GPU -> host", extra["pingpong"], 0.0, 0.0, 0.0, 0.0, 0.0])
    hdr = ["Session transfer", "latency us", "host us per call", "GB/s"]
    if "ce" in extra:
        hdr += ["plain copy, same bytes, us", "kernel GPU us", "fixed cost us (latency - kernel GPU)"]
    via = f" + copy proxy of {args.xgmi_proxy_blocks} blocks" if args.backend == "xgmi" and args.xgmi_proxy_blocks else ""
    print_table(f"summary: {route}{via} session writes (median; latency = submit to SUCCESS seen, eager)", hdr, rows,
                "plain copy: one contiguous torch copy_ of the same bytes (copy engines) until both GPUs are idle; "
                "kernel GPU: the scatter kernel alone in a CUDA graph; round trip: the host stores a word in pinned "
                "memory, a resident one-thread kernel answers in another (the copy proxy's floor); 0 = not measured")


def _plot(path: str, results: list[Result], args) -> None:
    from mori_core.bench.plot import Panel, PlotUnavailable, write_png

    panels = []
    for op in sorted({r.op for r in results}, reverse=True):
        panel = Panel(f"{op}, batch {args.batch}", "message size (bytes)", "GB/s")
        for mode in MODES:
            panel.add(mode, [(r.msg, r.gbps) for r in results if r.op == op and r.mode == mode])
        panels.append(panel)
    try:
        print(f"wrote {write_png(path, f'MORI-IO {args.backend}', panels, columns=len(panels))}")
    except (PlotUnavailable, ValueError) as e:
        print(e, file=sys.stderr)
