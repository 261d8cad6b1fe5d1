"""Fault scenarios of the chaos harness, each with real processes over loopback TCP.

* ``kill``      -- a peer is killed with SIGKILL in the middle of a 256 MiB write
                   (CPU memory): seconds until every status failed; then the
                   engine must serve a third peer.
* ``stall``     -- a peer is stopped with SIGSTOP in the middle of a transfer:
                   seconds until every status failed (the heartbeat's job);
                   after SIGCONT it serves again.
* ``reset``     -- a connection is reset in the middle of a frame, both ways:
                   a raw client resets half-way through a request (the target
                   keeps serving) and a proxy resets an engine's connection
                   half-way through a transfer (the status fails, the next
                   transfer succeeds).
* ``deregister``-- a target deregisters memory while a throttled write into it
                   drips in: seconds deregister_memory took, bytes that changed
                   after it returned (must be 0).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from mori_core.bench.netsim import Proxy, desc_at
from mori_core.bench.peer import LocalBuffer, TargetProcess
from mori_core.bench.wire import raw_handshake, request_header

__all__ = ["FaultResult", "FAULTS", "run_fault"]


@dataclass
class FaultResult:
    """One scenario: ``seconds`` is the figure it measures (detection or call time)."""

    fault: str
    seconds: float = 0.0
    detail: str = ""
    failures: List[str] = field(default_factory=list)


def _engine(key: str, **tcp: Any):
    from mori_core.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig

    e = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(**tcp))
    return e


def _checked_transfer(engine: Any, target: TargetProcess, size: int = 1 << 20) -> Optional[str]:
    """Write random bytes to a fresh region of ``target`` and compare; None when all is well."""
    from mori_core.io import StatusCode

    engine.register_remote_engine(target.desc)
    region, rm = target.region(size)
    local = LocalBuffer(engine, size)
    local.array[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    st = engine.write(local.desc, 0, rm, 0, size, engine.allocate_transfer_uid())
    code = st.WaitFor(15_000)
    ok = code == StatusCode.SUCCESS and bytes(region) == local.array.tobytes()
    region.release()
    engine.deregister_memory(local.desc)
    return None if ok else f"checked transfer failed ({code}: {st.Message()})"


def _wait_failed(engine: Any, statuses: list, bound_s: float) -> None:
    from mori_core.io import StatusCode

    if engine.wait_all(statuses, int(bound_s * 1000)) == StatusCode.IN_PROGRESS:
        raise TimeoutError(f"statuses still in progress after {bound_s:.0f} s")


# ------------------------------------------------------------------- kill -9
def fault_kill() -> FaultResult:
    res = FaultResult("kill -9 mid 256 MiB write")
    victim = TargetProcess("chaos-victim")
    third = None
    try:
        e = _engine("chaos-survivor", num_connections=4)
        e.register_remote_engine(victim.desc)
        size = 256 << 20
        region, rm = victim.region(size)
        local = LocalBuffer(e, size)
        local.array[:] = 1
        view = np.frombuffer(region, dtype=np.uint8)
        statuses = [e.write(local.desc, 0, rm, 0, size, 1)]
        deadline = time.monotonic() + 10
        while not view[:: 1 << 16].any() and time.monotonic() < deadline:  # the first bytes landed
            time.sleep(0.0005)
        landed = int(np.count_nonzero(view[:: 1 << 16])) << 16
        del view
        region.release()
        t0 = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        _wait_failed(e, statuses, 15)
        res.seconds = time.monotonic() - t0
        if not all(s.Failed() or s.Succeeded() for s in statuses):
            res.failures.append("a status did not end")
        res.detail = (f"killed after ~{landed >> 20} MiB of 256 landed; status failed" if statuses[0].Failed()
                      else "write finished before the kill")
        if not statuses[0].Failed():
            res.failures.append(res.detail)
        third = TargetProcess("chaos-third")
        err = _checked_transfer(e, third)
        if err:
            res.failures.append(f"third peer: {err}")
    except Exception as exc:
        res.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        victim.close()
        if third is not None:
            third.close()
    return res


# ------------------------------------------------------------------- SIGSTOP
def fault_stall() -> FaultResult:
    res = FaultResult("SIGSTOP mid transfer")
    t = TargetProcess("chaos-stalled")
    stopped = False
    try:
        e = _engine("chaos-stall-initiator", num_connections=2, chunk_bytes=1 << 20)
        size = 64 << 20
        e.register_remote_engine(t.desc)
        _, rm = t.region(size)
        local = LocalBuffer(e, size)
        statuses = [e.write(local.desc, 0, rm, 0, size, i + 1) for i in range(8)]
        t0 = time.monotonic()
        os.kill(t.proc.pid, signal.SIGSTOP)
        stopped = True
        _wait_failed(e, statuses, 15)
        res.seconds = time.monotonic() - t0
        res.detail = next((s.Message()[-60:] for s in statuses if s.Failed()), "")
        os.kill(t.proc.pid, signal.SIGCONT)
        stopped = False
        err = _checked_transfer(e, t)
        if err:
            res.failures.append(f"after SIGCONT: {err}")
    except Exception as exc:
        res.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        if stopped:
            os.kill(t.proc.pid, signal.SIGCONT)
        t.close()
    return res


# --------------------------------------------------------------------- reset
def fault_reset() -> FaultResult:
    from mori_core.io import StatusCode

    res = FaultResult("connection reset mid-frame")
    t = TargetProcess("chaos-reset-target")
    proxy = None
    try:
        region, rm = t.region(1 << 20)
        # 1. a raw client resets half-way through a write request
        for _ in range(20):
            s, _ = raw_handshake(t.desc.port, "chaos-resetter")
            frame = request_header(op=1, mem=rm.id, total=1 << 20) + struct.pack("<QQ", 0, 1 << 20)
            s.sendall(frame + b"\0" * 4096)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        # 2. an engine's own connection is reset half-way through its transfer
        e = _engine("chaos-reset-initiator", num_connections=1, chunk_bytes=4 << 20, heartbeat_timeout_ms=0)
        proxy = Proxy(t.desc.port, chunk=65536, reset_after=2 << 20)
        e.register_remote_engine(desc_at(t.desc, proxy.port))
        big_region, big_rm = t.region(8 << 20)
        local = LocalBuffer(e, 8 << 20)
        t0 = time.monotonic()
        st = e.write(local.desc, 0, big_rm, 0, 8 << 20, 1)
        code = st.WaitFor(15_000)
        res.seconds = time.monotonic() - t0
        if code != StatusCode.ERR_BAD_STATE:
            res.failures.append(f"reset transfer ended {code}: {st.Message()}")
        res.detail = st.Message()[-60:]
        big_region.release()
        proxy.close()
        proxy = None
        e.register_remote_engine(t.desc)  # the real address again: a fresh link
        err = _checked_transfer(e, t)
        if err:
            res.failures.append(f"after the reset: {err}")
        region.release()
    except Exception as exc:
        res.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        if proxy is not None:
            proxy.close()
        t.close()
    return res


def fault_deregister() -> FaultResult:
    res = FaultResult("deregister during a transfer")
    t = TargetProcess("chaos-dereg-target")
    proxy = Proxy(t.desc.port, rate=512 << 10)
    try:
        size = 16 << 20
        region, rm = t.region(size)
        e = _engine("chaos-dripper", num_connections=1, chunk_bytes=size)
        e.register_remote_engine(desc_at(t.desc, proxy.port))
        local = LocalBuffer(e, size)
        local.array[:] = 0xEE
        st = e.write(local.desc, 0, rm, 0, size, 1)
        view = np.frombuffer(region, dtype=np.uint8)
        deadline = time.monotonic() + 20
        while not view[:4096].any() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        t.call("deregister", rm.id, timeout=60)
        res.seconds = time.monotonic() - t0
        snapshot = view.copy()
        time.sleep(1.0)
        changed = int((view != snapshot).sum())
        res.detail = f"{changed} bytes changed after it returned"
        if changed:
            res.failures.append(res.detail)
        st.WaitFor(20_000)
        if not st.Failed():
            res.failures.append(f"the cut transfer ended {st.Code()}")
        del view
        region.release()
    except Exception as exc:
        res.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        proxy.close()
        t.close()
    return res


FAULTS: Dict[str, Callable[[], FaultResult]] = {
    "kill": fault_kill,
    "stall": fault_stall,
    "reset": fault_reset,
    "deregister": fault_deregister,
}


def run_fault(name: str) -> FaultResult:
    """Run scenario ``name`` (see the module docstring)."""
    return FAULTS[name]()
