"""Connection floods against an IO engine's control-plane listener (issue #29 items 3, 4 and 7).

Each attack gets a fresh target engine in its own process (its threads, descriptors, RSS and
log are its own); a spawned flooder process is the attacker, and this process is the
legitimate peer. Loopback only.

* ``silent``       -- connections that never send a byte;
* ``half-open``    -- connections that stop part-way into the handshake, in turn: half of a
  length prefix; half of a hello; a whole hello and never the proof; a prefix announcing
  1 KiB and 10 bytes of it;
* ``silent+half-open`` -- both at once (item 3's test: 5,000 + 2,000);
* ``many-sources`` -- bad inputs (random bytes, a wrong magic, a 4 GiB length prefix), each
  from its own source address 127.x.y.z, so a limit per source address does not help.

The flooder opens its connections (or sends its inputs) as fast as it can, then keeps the
flood going -- every connection the listener closes is replaced by a new one, and
``many-sources`` keeps sending -- while a *new* engine connects, writes 64 KiB of random
bytes and reads them back (timed, compared). Then the flood stops; the listener must come
back to its descriptor count and serve another checked transfer. Measured: the legitimate
transfer's time, the target's threads, descriptors and RSS (before, and the peak sampled
every 20 ms during the flood) and the log lines it wrote.

Nothing here needs a current tree: run against an older build's ``mori_core`` (with this
file and its siblings copied in), it measures the "before" of the table in docs/reliability.md.
"""

from __future__ import annotations

import os
import random
import resource
import selectors
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mori_core.bench.peer import process_stats
from mori_core.bench.spawned import SpawnedProcess
from mori_core.bench.wire import HELLO_MAGIC

__all__ = ["FLOODS", "FloodResult", "FloodTarget", "legit_transfer", "run_flood"]

# What each attack opens: (mode, count) pairs, by profile.
FLOODS: Dict[str, Dict[str, List[Tuple[str, int]]]] = {
    "silent": {"short": [("silent", 5000)], "long": [("silent", 12000)]},
    "half-open": {"short": [("half-open", 2000)], "long": [("half-open", 5000)]},
    "silent+half-open": {"short": [("silent", 5000), ("half-open", 2000)],
                         "long": [("silent", 12000), ("half-open", 5000)]},
    "many-sources": {"short": [("many-sources", 2000)], "long": [("many-sources", 10000)]},
}
REGION_BYTES = 64 << 10
SETTLE_S = 15.0  # how long the listener may take to close what the flood left (its handshake bound is 5 s)


@dataclass
class FloodResult:
    """One attack's outcome."""

    attack: str
    opened: int = 0  # connections opened (inputs sent) by the flooder, replacements included
    connect_failures: int = 0
    legit_s: Optional[float] = None  # the new engine's checked write + read during the flood
    legit_error: str = ""
    before: Dict[str, int] = field(default_factory=dict)
    peak: Dict[str, int] = field(default_factory=dict)
    after: Dict[str, int] = field(default_factory=dict)
    log_lines: int = 0
    seconds: float = 0.0
    failures: List[str] = field(default_factory=list)


# --------------------------------------------------------------------- target
def _raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _target_serve(pipe: Any, log_path: str, env: Dict[str, str], fd_limit: int) -> None:
    """A TCP target engine whose stderr (the engine's log) goes to ``log_path``; ``fd_limit``
    > 0 lowers its descriptor limit to that, else it is raised to the hard limit."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    if fd_limit > 0:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    else:
        _raise_fd_limit()  # as a server would run: the "before" build needs a descriptor per connection
    from mori_core.bench.peer import _serve

    _serve(pipe, "chaos-flood-target", "", {"num_connections": 1})


class FloodTarget:
    """A target engine in its own process with a 64 KiB shared, registered region (``mem``)."""

    def __init__(self, log_path: str, env: Dict[str, str], fd_limit: int = 0) -> None:
        from multiprocessing import shared_memory

        from mori_core.io import EngineDesc, MemoryDesc

        self.proc = SpawnedProcess(_target_serve, (log_path, env, fd_limit), start_timeout=60, call_timeout=30)
        self.desc = EngineDesc.unpack(self.proc.hello)
        self.shm = shared_memory.SharedMemory(create=True, size=REGION_BYTES)
        self.region = self.shm.buf
        self.mem = MemoryDesc.unpack(self.proc.call("register", self.shm.name))

    def stats(self) -> Dict[str, int]:
        return process_stats(self.proc.proc.pid)

    def close(self) -> None:
        self.proc.close()
        self.region = None
        self.shm.close()
        self.shm.unlink()


def legit_transfer(target: FloodTarget, n: int, timeout_ms: int = 10_000) -> Tuple[Optional[float], str]:
    """A new engine registers the target, writes 64 KiB of random bytes and reads them back.
    Returns (seconds from registering to the checked read-back, "") or (None, error)."""
    import numpy as np

    from mori_core.bench.peer import LocalBuffer
    from mori_core.io import BackendType, IOEngine, IOEngineConfig, StatusCode, TcpBackendConfig

    e = IOEngine(f"chaos-legit-{os.getpid()}-{n}", IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2))
    local, back = LocalBuffer(e, REGION_BYTES), LocalBuffer(e, REGION_BYTES)
    local.array[:] = np.frombuffer(os.urandom(REGION_BYTES), dtype=np.uint8)
    t0 = time.monotonic()
    e.register_remote_engine(target.desc)
    w = e.write(local.desc, 0, target.mem, 0, REGION_BYTES, 1)
    if w.WaitFor(timeout_ms) != StatusCode.SUCCESS:
        return None, f"write: {w.Message() or 'not done within ' + str(timeout_ms) + ' ms'}"
    r = e.read(back.desc, 0, target.mem, 0, REGION_BYTES, 2)
    if r.WaitFor(timeout_ms) != StatusCode.SUCCESS:
        return None, f"read: {r.Message() or 'not done within ' + str(timeout_ms) + ' ms'}"
    took = time.monotonic() - t0
    if bytes(target.region) != local.array.tobytes() or (back.array != local.array).any():
        return None, "checksum mismatch"
    return took, ""


class _Sampler:
    """Peak threads / descriptors / RSS of a process, sampled every 20 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak: Dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = process_stats(self.pid)
            except (OSError, ValueError):  # a descriptor closed while /proc was listed
                continue
            for k, v in s.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            self._stop.wait(0.02)

    def stop(self) -> Dict[str, int]:
        self._stop.set()
        self._thread.join(5)
        return self.peak


# -------------------------------------------------------------------- flooder
def _source_address(i: int) -> str:
    """The i-th distinct loopback address 127.x.y.z (x >= 1: never 127.0.0.1)."""
    z = 1 + i % 254
    y = (i // 254) % 256
    x = 1 + (i // (254 * 256)) % 254
    return f"127.{x}.{y}.{z}"


def _hello(magic: int = HELLO_MAGIC) -> bytes:
    body = struct.pack("<IHB", magic, 2, 1) + os.urandom(32)
    return struct.pack("<I", len(body)) + body


def _half_open_bytes(i: int) -> bytes:
    kind = i % 4
    hello = _hello()
    if kind == 0:
        return hello[:2]  # half of the length prefix
    if kind == 1:
        return hello[:24]  # half of the hello
    if kind == 2:
        return hello  # the whole hello; the proof never comes
    return struct.pack("<I", 1024) + os.urandom(10)  # 1 KiB announced, 10 bytes sent


def _bad_input(rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:
        return rng.randbytes(rng.randint(1, 64))
    if kind == 1:
        return _hello(magic=rng.randrange(1 << 32) | 1)  # a wrong magic (HELLO_MAGIC is even)
    return struct.pack("<I", 0xFFFFFFFF) + rng.randbytes(16)


def _open(port: int, mode: str, i: int, rng: random.Random) -> Optional[socket.socket]:
    """One connection of the flood (None: many-sources, already closed)."""
    if mode == "many-sources":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((_source_address(i), 0))
            s.settimeout(2.0)
            s.connect(("127.0.0.1", port))
            s.sendall(_bad_input(rng))
        finally:
            s.close()
        return None
    s = socket.create_connection(("127.0.0.1", port), timeout=2.0)
    if mode == "half-open":
        s.sendall(_half_open_bytes(i))
    s.setblocking(False)
    return s


def _flooder(pipe: Any, port: int, plan: List[Tuple[str, int]], seed: int) -> None:
    """Opens the planned connections, says "ready", keeps the flood up until "stop", reports counts."""
    limit = _raise_fd_limit()
    rng = random.Random(seed)
    sel = selectors.DefaultSelector()
    opened = failures = 0
    index: Dict[str, int] = {}

    def open_one(mode: str) -> None:
        nonlocal opened, failures
        i = index.get(mode, 0)
        index[mode] = i + 1
        try:
            s = _open(port, mode, i, rng)
        except OSError:
            failures += 1
            return
        opened += 1
        if s is not None:
            sel.register(s, selectors.EVENT_READ, mode)

    held = sum(n for m, n in plan if m != "many-sources")
    if held + 64 > limit:
        pipe.send(RuntimeError(f"the flooder may open {limit} descriptors, the plan holds {held}: "
                               "raise the hard limit (ulimit -Hn) or use fewer connections"))
        return
    # Interleave the modes, as a mixed flood would arrive.
    queue = [m for m, n in plan for _ in range(n)]
    random.Random(seed).shuffle(queue)
    for mode in queue:
        open_one(mode)
    pipe.send(("ready", opened, failures))
    sustain = [m for m, _ in plan if m == "many-sources"]
    while not pipe.poll(0):
        for key, _ in sel.select(timeout=0 if sustain else 0.01):
            s = key.fileobj
            try:
                gone = s.recv(4096) == b""  # type: ignore[union-attr]
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:  # the listener closed it: a new one takes its place
                sel.unregister(s)
                s.close()  # type: ignore[union-attr]
                open_one(key.data)
        for mode in sustain:
            for _ in range(20):
                open_one(mode)
    pipe.recv()
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    pipe.send(("done", opened, failures))


# ----------------------------------------------------------------------- run
def _log_lines(path: str) -> int:
    with open(path, errors="replace") as f:
        return sum(1 for line in f if line.startswith("[mori "))


def run_flood(attack: str, profile: str = "short", env: Optional[Dict[str, str]] = None,
              max_legit_s: float = 1.0, max_thread_growth: int = 32, max_log_lines: int = 100,
              max_rss_growth_mb: float = 64.0, fd_slack: int = 8) -> FloodResult:
    """Run one attack of :data:`FLOODS` against a fresh target; every step is bounded.

    Failures: the legitimate transfer during the flood fails or takes more than
    ``max_legit_s``; the target's threads grow by more than ``max_thread_growth`` or its RSS
    by more than ``max_rss_growth_mb``; it writes more than ``max_log_lines`` log lines; or
    after the flood its descriptors do not come back (within ``fd_slack``, 15 s) or it does
    not serve a checked transfer.
    """
    plan = FLOODS[attack][profile]
    res = FloodResult(attack)
    t_start = time.monotonic()
    _raise_fd_limit()
    log = tempfile.NamedTemporaryFile(prefix="chaos-flood-", suffix=".log", delete=False)
    log.close()
    target: Optional[FloodTarget] = None
    flooder: Optional[SpawnedProcess] = None
    try:
        target = FloodTarget(log.name, dict(env or {}))
        took, err = legit_transfer(target, 0)  # warm: the target serves before the flood
        if took is None:
            res.failures.append(f"before the flood: {err}")
            return res
        time.sleep(0.2)
        res.before = target.stats()
        sampler = _Sampler(target.proc.proc.pid)
        try:
            flooder = SpawnedProcess(_flooder, (target.desc.port, plan, 29), start_timeout=300, call_timeout=60)
            _, res.opened, res.connect_failures = flooder.hello
            res.legit_s, res.legit_error = legit_transfer(target, 1)
            flooder.send("stop")
            _, res.opened, res.connect_failures = flooder.result(60, "stop")
        finally:
            res.peak = sampler.stop()
        flooder.close()
        flooder = None
        deadline = time.monotonic() + SETTLE_S
        while True:
            res.after = target.stats()
            if res.after["fds"] <= res.before["fds"] + fd_slack or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        took, err = legit_transfer(target, 2)
        if took is None:
            res.failures.append(f"after the flood: {err}")
    except Exception as exc:  # a crashed target, a flooder that could not run
        res.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        if flooder is not None:
            flooder.kill()
        if target is not None:
            target.close()
        res.log_lines = _log_lines(log.name)
        os.unlink(log.name)
        res.seconds = time.monotonic() - t_start
    if res.legit_s is None:
        res.failures.append(f"legitimate transfer during the flood failed: {res.legit_error}")
    elif res.legit_s > max_legit_s:
        res.failures.append(f"legitimate transfer during the flood took {res.legit_s:.2f} s (bound {max_legit_s:g})")
    if res.before and res.peak:
        if res.peak["threads"] - res.before["threads"] > max_thread_growth:
            res.failures.append(f"threads grew from {res.before['threads']} to {res.peak['threads']} "
                                f"(bound +{max_thread_growth})")
        if res.peak["rss"] - res.before["rss"] > max_rss_growth_mb * (1 << 20):
            res.failures.append(f"RSS grew by {(res.peak['rss'] - res.before['rss']) / (1 << 20):.0f} MiB "
                                f"(bound {max_rss_growth_mb:g})")
    if res.before and res.after and res.after["fds"] > res.before["fds"] + fd_slack:
        res.failures.append(f"descriptors did not come back: {res.before['fds']} before, {res.after['fds']} "
                            f"{SETTLE_S:g} s after the flood")
    if res.log_lines > max_log_lines:
        res.failures.append(f"{res.log_lines} log lines (bound {max_log_lines})")
    return res
