"""``python -m mori_core.bench io``: MORI-IO's benchmark matrix between two local processes.

Modes follow MORI's benchmark: {single, batch} x {engine, session} for read and
write. "single" submits ``batch`` separate transfers and waits for all of them;
"batch" submits one batched transfer of ``batch`` scattered segments. Every
number is the median over iterations of the wall time from the first submit to
the last completion, measured on the initiator. A baseline measured in the same
run sits beside it: a raw TCP socket for the TCP backend, a plain copy-engine
peer copy (torch ``Tensor.copy_``) for the XGMI backend.
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
from typing import Callable, Optional

from mori_core.bench.table import fmt_bytes, median, print_table

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
    p.add_argument("--initiator-device", type=int, default=0)
    p.add_argument("--target-device", type=int, default=1)
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


def _make_engine(key: str, backend: str, num_connections: int):
    from mori_core.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig, XgmiBackendConfig

    # A TCP measurement must stay on TCP even for GPU memory on one node.
    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0, enable_auto_xgmi=backend == "xgmi"))
    if backend == "tcp":
        engine.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=num_connections))
    else:
        # Like MORI's benchmark: no target notifications in the timed loop.
        engine.create_backend(BackendType.XGMI, XgmiBackendConfig(enable_notification=False))
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


def _target_main(pipe, backend: str, mem: str, device: int, nbytes: int, num_connections: int) -> None:
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
    pipe.send((engine.get_engine_desc().pack(), md.pack(), raw.getsockname()[1]))
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

    @property
    def gbps(self) -> float:
        return self.msg * self.batch / (self.lat_us * 1e-6) / 1e9


def _time(fn: Callable[[], None], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _check(statuses) -> None:
    from mori_core.io import StatusCode, wait_all

    code = wait_all(statuses, 60_000)
    if code != StatusCode.SUCCESS:
        bad = next((s for s in statuses if not s.Succeeded()), None)
        raise RuntimeError(f"transfer failed: {code} {bad.Message() if bad else ''}")


def _runner(engine, session, lm, rm, op: str, mode: str, msg: int, batch: int) -> Callable[[], None]:
    offs = [i * 2 * msg for i in range(batch)]  # scattered: never merged
    sizes = [msg] * batch
    read = op == "read"
    if mode == "single":
        f = engine.read if read else engine.write
        return lambda: _check([f(lm, o, rm, o, msg, engine.allocate_transfer_uid()) for o in offs])
    if mode == "single+session":
        f = session.read if read else session.write
        return lambda: _check([f(o, o, msg, session.allocate_transfer_uid()) for o in offs])
    if mode == "batch":
        f = engine.batch_read if read else engine.batch_write
        return lambda: _check(f([lm], [offs], [rm], [offs], [sizes], [engine.allocate_transfer_uid()]))
    f = session.batch_read if read else session.batch_write
    return lambda: _check([f(offs, offs, sizes, session.allocate_transfer_uid())])


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


def _copy_baseline(nbytes: int, src_dev: int, dst_dev: int, iters: int, warmup: int) -> list[float]:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")

    def once() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dst_dev)
        torch.cuda.synchronize(src_dev)

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
    nbytes = max(max(sizes) * 2 * args.batch, large)

    from mori_core.io import EngineDesc, MemoryDesc

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target_main, args=(child, args.backend, mem, args.target_device, nbytes, args.num_connections), daemon=True)
    proc.start()
    child.close()  # so a dying target shows up as EOF on the pipe
    try:
        for _ in range(180):
            if parent.poll(1) or not proc.is_alive():
                break
        if not proc.is_alive():
            raise RuntimeError(f"target process exited with code {proc.exitcode} before it was ready")
        if not parent.poll(0):
            raise RuntimeError("target process did not start within 180 s")
        tdesc, tmem, raw_port = parent.recv()
        engine = _make_engine("bench-initiator", args.backend, args.num_connections)
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
                    lat = _time(_runner(engine, session, lm, rm, op, mode, msg, args.batch), args.iters, args.warmup)
                    results.append(Result(op, mode, msg, args.batch, median(lat), min(lat)))
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()

        large_rows = []
        if large:
            lat = _time(_runner(engine, session, lm, rm, "write", "batch+session", large, 1), args.large_iters, 2)
            base = (_raw_baseline(raw_port, large, args.large_iters, 2) if args.backend == "tcp"
                    else _copy_baseline(large, args.initiator_device, args.target_device, args.large_iters, 2))
            bw, bbw = large / median(lat) / 1e3, large / median(base) / 1e3
            large_rows.append([fmt_bytes(large), f"{median(lat):.0f}", f"{bw:.2f}", f"{median(base):.0f}", f"{bbw:.2f}", f"{bw / bbw:.2f}x"])
        parent.send("stop")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()

    _report(args, results, large_rows, mem, str(route).split(".")[-1], sizes)
    if args.plot:
        _plot(args.plot, results, args)
    return 0


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


def _report(args, results: list[Result], large_rows, mem: str, route: str, sizes) -> None:
    hdr = ["Msg Size", "Batch", "Total"] + [m for m in MODES]
    note = (f"backend {route}, {mem} memory, median of {args.iters} iterations after {args.warmup} warm-up; "
            f"hardware: {_hardware(mem)}")
    for op in sorted({r.op for r in results}, reverse=True):
        rows_bw, rows_lat = [], []
        for msg in sizes:
            rs = {r.mode: r for r in results if r.op == op and r.msg == msg}
            base = [fmt_bytes(msg), args.batch, fmt_bytes(msg * args.batch)]
            rows_bw.append(base + [rs[m].gbps for m in MODES])
            rows_lat.append(base + [rs[m].lat_us for m in MODES])
        print_table(f"{op}: bandwidth (GB/s, median)", hdr, rows_bw)
        print_table(f"{op}: latency per iteration (us, median)", hdr, rows_lat, note)
    if large_rows:
        base_name = "raw socket" if args.backend == "tcp" else "copy-engine peer copy"
        print_table(f"one large write vs {base_name} (same run)",
                    ["Size", "MORI-IO us", "MORI-IO GB/s", f"{base_name} us", f"{base_name} GB/s", "ratio"],
                    large_rows, note)


def _plot(path: str, results: list[Result], args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len({r.op for r in results}), figsize=(11, 4), squeeze=False)
    for ax, op in zip(axes[0], sorted({r.op for r in results}, reverse=True)):
        for mode in MODES:
            pts = sorted((r.msg, r.gbps) for r in results if r.op == op and r.mode == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"MORI-IO {args.backend} {op}, batch {args.batch}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
