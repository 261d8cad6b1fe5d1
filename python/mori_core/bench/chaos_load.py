"""Load of the chaos harness: process pairs doing checksummed batch writes and reads.

Each pair is a target process (memory in shared memory) and an initiator
process. For a bounded time the initiator writes a batch of 1-16 random
segments of 4-64 KiB (random bytes) into distinct slots of the target's region,
reads them back into a second buffer and compares. A transfer that does not end
within its bound is *lost*; one that fails is an *error*; one whose bytes differ
is *corrupt*. Latency is per batch call, submit to completion.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, List

import numpy as np

from mori_core.bench.peer import TargetProcess
from mori_core.bench.spawned import SpawnedProcess

__all__ = ["LoadResult", "run_load"]

SLOT = 64 << 10
SLOTS = 64
BOUND_MS = 10_000


@dataclass
class LoadResult:
    pairs: int
    seconds: float = 0.0
    transfers: int = 0
    bytes: int = 0
    errors: int = 0
    lost: int = 0
    corrupt: int = 0
    latencies_ms: List[float] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else 0.0


def _initiator(pipe: Any, index: int) -> None:
    from mori_core.io import (BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType,
                              StatusCode, TcpBackendConfig)

    engine = IOEngine(f"chaos-load-{index}", IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2))
    size = SLOT * SLOTS
    out, back = np.zeros(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    lo = engine.register_memory(out.ctypes.data, size, -1, MemoryLocationType.CPU)
    lb = engine.register_memory(back.ctypes.data, size, -1, MemoryLocationType.CPU)
    pipe.send(os.getpid())
    cmd, (desc_packed, mem_packed, seconds, seed) = pipe.recv()
    engine.register_remote_engine(EngineDesc.unpack(desc_packed))
    rm = MemoryDesc.unpack(mem_packed)
    rng = np.random.default_rng(seed)
    stats = {"transfers": 0, "bytes": 0, "errors": 0, "lost": 0, "corrupt": 0, "lat": [], "first_error": ""}
    deadline = time.monotonic() + seconds

    def run(call: Any, local: Any, offs: list, sizes: list) -> bool:
        t0 = time.perf_counter()
        st = call([local], [offs], [rm], [offs], [sizes], [engine.allocate_transfer_uid()])[0]
        code = st.WaitFor(BOUND_MS)
        stats["lat"].append((time.perf_counter() - t0) * 1000)
        stats["transfers"] += 1
        if code == StatusCode.IN_PROGRESS:
            stats["lost"] += 1
        elif code != StatusCode.SUCCESS:
            stats["errors"] += 1
            stats["first_error"] = stats["first_error"] or st.Message()
        else:
            stats["bytes"] += sum(sizes)
            return True
        return False

    while time.monotonic() < deadline:
        n = int(rng.integers(1, 17))
        slots = rng.choice(SLOTS, n, replace=False)
        offs = [int(s) * SLOT for s in slots]
        sizes = [int(rng.integers(4 << 10, (64 << 10) + 1)) for _ in range(n)]
        for o, sz in zip(offs, sizes):
            out[o:o + sz] = rng.integers(0, 256, sz, dtype=np.uint8)
            back[o:o + sz] = 0
        if not run(engine.batch_write, lo, offs, sizes):
            continue
        if run(engine.batch_read, lb, offs, sizes):
            if any(not np.array_equal(out[o:o + sz], back[o:o + sz]) for o, sz in zip(offs, sizes)):
                stats["corrupt"] += 1
    pipe.send(stats)
    pipe.recv()  # stop
    pipe.send(True)


def run_load(pairs: int = 8, seconds: float = 30.0, seed: int = 21) -> LoadResult:
    """``pairs`` initiator/target process pairs for ``seconds`` each (run at once)."""
    res = LoadResult(pairs)
    targets: List[TargetProcess] = []
    inits: List[SpawnedProcess] = []
    try:
        for i in range(pairs):
            targets.append(TargetProcess(f"chaos-load-target-{i}"))
            inits.append(SpawnedProcess(_initiator, (i,), start_timeout=60, call_timeout=seconds + 60))
        regions = [t.region(SLOT * SLOTS) for t in targets]
        t0 = time.monotonic()
        for i, (p, t) in enumerate(zip(inits, targets)):
            p.send("run", (t.desc.pack(), regions[i][1].pack(), seconds, seed + i))
        for p in inits:
            s = p.result(seconds + 120, "run")
            res.transfers += s["transfers"]
            res.bytes += s["bytes"]
            res.errors += s["errors"]
            res.lost += s["lost"]
            res.corrupt += s["corrupt"]
            res.latencies_ms += s["lat"]
            if s["first_error"]:
                res.failures.append(f"error: {s['first_error']}")
        res.seconds = time.monotonic() - t0
        for buf, _ in regions:
            buf.release()
    except Exception as exc:
        res.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        for p in inits + targets:
            try:
                p.close()
            except Exception:
                pass
    if res.lost or res.corrupt:
        res.failures.append(f"{res.lost} lost, {res.corrupt} corrupt")
    if res.transfers == 0:
        res.failures.append("no transfer completed")
    return res
