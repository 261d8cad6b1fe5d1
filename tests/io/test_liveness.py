"""Deregistration under a slow transfer, stopped peers, slow-but-live peers, idle connections.

Regression tests of issue #21 item 5 (use after deregistration) and of its weak
spots (a SIGSTOPped peer noticed only after 10 s; one thread per idle
connection, kept forever; issue #29: still one thread per connection). Real
engines in real processes over loopback TCP; a throttling proxy
(tests/io/net_tools.py) makes a transfer slow but alive.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import threading
import time

import numpy as np
import pytest

from io_peer import LocalBuffer, TargetProcess
from mori_core.bench.wire import raw_handshake
from mori_core.io import BackendType, IOEngine, IOEngineConfig, StatusCode, TcpBackendConfig
from net_tools import Proxy, desc_at


def _engine(key: str, **tcp) -> IOEngine:
    e = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(**tcp))
    return e


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_deregister_cuts_a_dripping_inbound_write():
    """Item 5: the owner deregisters a region while a write into it drips in. The call
    must return only when nothing can write there any more: afterwards the region's
    bytes never change, even though the peer keeps sending."""
    t = TargetProcess("dereg-target")
    proxy = Proxy(t.desc.port, rate=256 << 10)  # 16 MiB at 256 KiB/s: about a minute
    try:
        _dripping_write_then_deregister(t, proxy)
    finally:
        proxy.close()
        t.close()


def _dripping_write_then_deregister(t: TargetProcess, proxy: Proxy) -> None:
    size = 16 << 20
    region, rm = t.region(size)
    view = np.frombuffer(region, dtype=np.uint8)
    view[:] = 0
    e = _engine("dripper", num_connections=1, chunk_bytes=size)
    e.register_remote_engine(desc_at(t.desc, proxy.port))
    local = LocalBuffer(e, size)
    local.array[:] = 0xEE
    st = e.write(local.desc, 0, rm, 0, size, 1)
    deadline = time.monotonic() + 20
    while not view[:4096].any() and time.monotonic() < deadline:  # the first bytes landed
        time.sleep(0.05)
    assert view[:4096].any(), "the slow write never started"
    t0 = time.monotonic()
    t.call("deregister", rm.id, timeout=60)
    took = time.monotonic() - t0
    snapshot = view.copy()
    time.sleep(1.5)  # the peer keeps dripping meanwhile
    assert (view == snapshot).all(), (
        f"{int((view != snapshot).sum())} bytes changed after deregister_memory returned ({took:.1f} s)")
    assert took < 5.0, f"deregister_memory took {took:.1f} s"
    assert st.WaitFor(20_000) == StatusCode.ERR_BAD_STATE, st.Message()


def test_stopped_peer_is_detected_within_two_seconds():
    """A SIGSTOPped target: its kernel still acknowledges, only the heartbeat can tell.
    Every status must fail within 2 s, and a fresh transfer must fail fast too."""
    t = TargetProcess("stopped-target")
    stopped = False
    try:
        e = _engine("stopped-initiator", num_connections=2, chunk_bytes=1 << 20)
        e.register_remote_engine(t.desc)
        size = 64 << 20
        _, rm = t.region(size)
        local = LocalBuffer(e, size)
        assert e.write(local.desc, 0, rm, 0, 4096, 0).WaitFor(10_000) == StatusCode.SUCCESS
        statuses = [e.write(local.desc, 0, rm, 0, size, i + 1) for i in range(8)]
        os.kill(t.proc.pid, signal.SIGSTOP)
        stopped = True
        t0 = time.monotonic()
        code = e.wait_all(statuses, 15_000)
        elapsed = time.monotonic() - t0
        assert code == StatusCode.ERR_BAD_STATE, code
        assert elapsed <= 2.0, f"stopped peer noticed after {elapsed:.2f} s"
        assert any("heartbeat" in s.Message() for s in statuses if s.Failed()), [s.Message() for s in statuses]
        t0 = time.monotonic()
        assert e.write(local.desc, 0, rm, 0, 8, 99).WaitFor(10_000) == StatusCode.ERR_BAD_STATE
        assert time.monotonic() - t0 <= 2.5
        # the peer comes back: transfers work again
        os.kill(t.proc.pid, signal.SIGCONT)
        stopped = False
        assert e.write(local.desc, 0, rm, 0, 4096, 100).WaitFor(10_000) == StatusCode.SUCCESS
    finally:
        if stopped:
            os.kill(t.proc.pid, signal.SIGCONT)
        t.close()


def test_slow_but_live_transfer_is_not_failed():
    """A transfer that takes several heartbeat timeouts (a throttled link) completes."""
    t = TargetProcess("slow-target")
    proxy = Proxy(t.desc.port, rate=1 << 20)  # 4 MiB at 1 MiB/s: ~4 s, vs a 1.5 s heartbeat bound
    try:
        _slow_write(t, proxy)
    finally:
        proxy.close()
        t.close()


def _slow_write(t: TargetProcess, proxy: Proxy) -> None:
    size = 4 << 20
    region, rm = t.region(size)
    e = _engine("slow-initiator", num_connections=1, chunk_bytes=size)
    e.register_remote_engine(desc_at(t.desc, proxy.port))
    local = LocalBuffer(e, size)
    local.array[:] = np.arange(size, dtype=np.uint64).view(np.uint8)[:size]
    t0 = time.monotonic()
    st = e.write(local.desc, 0, rm, 0, size, 1)
    assert st.WaitFor(30_000) == StatusCode.SUCCESS, st.Message()
    assert time.monotonic() - t0 > 2.0, "the link was not slow: the test proves nothing"
    assert (np.frombuffer(region, dtype=np.uint8) == local.array).all()


def _all_closed_by_peer(socks: list, within_s: float) -> float:
    """Seconds until the listener closed every socket in ``socks`` (inf if not within ``within_s``)."""
    t0 = time.monotonic()
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    left = set(socks)
    while left and time.monotonic() - t0 < within_s:
        for key, _ in sel.select(timeout=0.1):
            try:
                gone = key.fileobj.recv(4096) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                sel.unregister(key.fileobj)
                left.discard(key.fileobj)
    sel.close()
    return time.monotonic() - t0 if not left else float("inf")


def test_idle_connections_hold_no_thread_and_time_out(monkeypatch):
    """Idle connections cost the target no thread (issue #29 item 3: main had one per
    connection): 100 authenticated but idle connections and 100 silent ones leave it at
    most MORI_IO_SERVE_THREADS (here 4) more threads. The silent ones are closed at the
    handshake bound (MORI_IO_CP_TIMEOUT_MS), the idle ones after MORI_IO_IDLE_TIMEOUT_MS;
    an initiator retires its own first, so its next transfer still succeeds."""
    monkeypatch.setenv("MORI_IO_IDLE_TIMEOUT_MS", "1500")
    monkeypatch.setenv("MORI_IO_CP_TIMEOUT_MS", "1000")
    monkeypatch.setenv("MORI_IO_SERVE_THREADS", "4")
    t = TargetProcess("idle-target")
    try:
        e = _engine("idle-initiator", num_connections=2)
        e.register_remote_engine(t.desc)
        region, rm = t.region(4096)
        local = LocalBuffer(e, 4096)
        assert e.write(local.desc, 0, rm, 0, 4096, 1).WaitFor(10_000) == StatusCode.SUCCESS
        base = _threads(t.proc.pid)
        t0 = time.monotonic()
        idle = [raw_handshake(t.desc.port, f"idle-{i}")[0] for i in range(100)]
        silent = [socket.create_connection(("127.0.0.1", t.desc.port)) for _ in range(100)]
        time.sleep(0.3)
        assert _threads(t.proc.pid) <= base + 4, f"{_threads(t.proc.pid)} threads, {base} before"
        silent_s = _all_closed_by_peer(silent, 4.0)
        assert silent_s <= 2.0, f"silent connections lived {silent_s:.2f} s more (handshake bound 1 s)"
        _all_closed_by_peer(idle, 6.0)
        idle_s = time.monotonic() - t0
        assert 1.4 <= idle_s <= 5.0, f"idle connections closed after {idle_s:.2f} s (idle timeout 1.5 s)"
        for s in idle + silent:
            s.close()
        local.array[:] = 7
        for uid in range(2, 6):  # across the initiator's own idle retirement
            assert e.write(local.desc, 0, rm, 0, 4096, uid).WaitFor(10_000) == StatusCode.SUCCESS
            time.sleep(0.9)
        assert bytes(region[:4]) == b"\x07" * 4
    finally:
        t.close()


def test_deregister_cuts_a_dripping_outbound_read():
    """The initiator's side of item 5: its own READ drips into a local region it then
    deregisters; after the call returns, the local bytes never change."""
    t = TargetProcess("dereg-read-target")
    proxy = Proxy(t.desc.port, rate=256 << 10)
    try:
        size = 16 << 20
        region, rm = t.region(size)
        np.frombuffer(region, dtype=np.uint8)[:] = 0xAB
        e = _engine("dereg-reader", num_connections=1, chunk_bytes=size, heartbeat_timeout_ms=0)
        e.register_remote_engine(desc_at(t.desc, proxy.port))
        local = LocalBuffer(e, size)
        st = e.read(local.desc, 0, rm, 0, size, 1)
        deadline = time.monotonic() + 20
        while not local.array[:4096].any() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert local.array[:4096].any(), "the slow read never started"
        t0 = time.monotonic()
        e.deregister_memory(local.desc)
        took = time.monotonic() - t0
        snapshot = local.array.copy()
        time.sleep(1.5)
        assert (local.array == snapshot).all(), f"{int((local.array != snapshot).sum())} bytes changed after return"
        assert took < 5.0, f"deregister_memory took {took:.1f} s"
        assert st.WaitFor(10_000) == StatusCode.ERR_BAD_STATE, st.Message()
        assert "deregistered" in st.Message(), st.Message()
        del region
    finally:
        proxy.close()
        t.close()
