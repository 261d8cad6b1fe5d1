"""Bad input and faults: bounds, unknown peers/memory, hostile frames, dead peers, auth."""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import pytest

from mori_core.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TcpBackendConfig,
)

from io_peer import LocalBuffer, TargetProcess
from mori_core.bench.wire import raw_handshake, read_reply, request_header

POISON = 0x5A


def _local(engine, size):
    return LocalBuffer(engine, size)


# ------------------------------------------------------------------ bounds
@pytest.mark.parametrize("op", ["write", "read"])
def test_out_of_bounds_rejected_nothing_written(initiator, target, op):
    local = _local(initiator, 4096)
    remote_buf, rm = target.region(4096)
    remote = np.frombuffer(remote_buf, dtype=np.uint8)
    remote[:] = POISON
    local.array[:] = POISON
    f = initiator.read if op == "read" else initiator.write
    for lo, ro, n in [(0, 4000, 200), (4000, 0, 200), (0, 0, 4097), (2**62, 0, 8)]:
        st = f(local.desc, lo, rm, ro, n, initiator.allocate_transfer_uid())
        assert st.Failed() and st.Code() == StatusCode.ERR_INVALID_ARGS, (lo, ro, n)
        assert "exceeds the registered size" in st.Message()
    st = initiator.batch_write([local.desc], [[0, 0]], [rm], [[0, 4090]], [[8, 8]], [1])[0]
    assert st.Code() == StatusCode.ERR_INVALID_ARGS and "segment 1" in st.Message()
    assert (remote == POISON).all() and (local.array == POISON).all()


def test_owner_checks_bounds_even_if_descriptor_lies(initiator, target):
    """A forged MemoryDesc with a larger size passes the initiator's check; the owner refuses."""
    local = _local(initiator, 8192)
    local.array[:] = 7
    remote_buf, rm = target.region(4096)
    remote = np.frombuffer(remote_buf, dtype=np.uint8)
    remote[:] = POISON
    packed = bytearray(rm.pack())
    # size is the u64 after data; find it by value and patch it to 1 MiB
    pos = packed.find(struct.pack("<Q", 4096))
    packed[pos:pos + 8] = struct.pack("<Q", 1 << 20)
    forged = MemoryDesc.unpack(bytes(packed))
    assert forged.size == 1 << 20
    st = initiator.write(local.desc, 0, forged, 0, 8192, initiator.allocate_transfer_uid())
    assert st.WaitFor(10_000) == StatusCode.ERR_INVALID_ARGS, st.Message()
    assert "refused" in st.Message()
    assert (remote == POISON).all()


def test_mismatched_batch_lists(initiator, target):
    local = _local(initiator, 4096)
    _, rm = target.region(4096)
    with pytest.raises(ValueError, match="same length"):
        initiator.batch_write([local.desc], [[0]], [rm, rm], [[0]], [[8]], [1])
    st = initiator.batch_write([local.desc], [[0, 8]], [rm], [[0]], [[8]], [1])[0]
    assert st.Code() == StatusCode.ERR_INVALID_ARGS and "same length" in st.Message()
    with pytest.raises(TypeError, match=r"sizes\[0\]"):
        initiator.batch_write([local.desc], [[0]], [rm], [[0]], [[-8]], [1])


# ----------------------------------------------------- unknown / deregistered
def test_unknown_remote_engine_and_memory(initiator, target):
    local = _local(initiator, 4096)
    _, rm = target.region(4096)
    other = IOEngine("stranger", IOEngineConfig("127.0.0.1", 0))
    other.create_backend(BackendType.TCP)
    stranger_mem = other.register_memory(local.array.ctypes.data, 4096, -1, MemoryLocationType.CPU)
    st = initiator.write(local.desc, 0, stranger_mem, 0, 8, 1)
    assert st.Code() == StatusCode.ERR_NOT_FOUND and "not registered" in st.Message()
    assert initiator.create_session(local.desc, stranger_mem) is None
    # a memory id the target never registered
    packed = bytearray(rm.pack())
    idpos = 4 + 4 + len(rm.engine_key)
    packed[idpos:idpos + 4] = struct.pack("<I", 999999)
    ghost = MemoryDesc.unpack(bytes(packed))
    assert ghost.id == 999999
    st = initiator.write(local.desc, 0, ghost, 0, 8, 2)
    assert st.WaitFor(10_000) == StatusCode.ERR_NOT_FOUND, st.Message()


def test_no_backend_is_bad_state(target):
    e = IOEngine("no-backend", IOEngineConfig("127.0.0.1", 0))
    e.register_remote_engine(target.desc)
    local = _local(e, 4096)
    _, rm = target.region(4096)
    st = e.write(local.desc, 0, rm, 0, 8, 1)
    assert st.Code() == StatusCode.ERR_BAD_STATE and "no available backend" in st.Message()
    assert e.create_session(local.desc, rm) is None


def test_deregistered_memory_is_refused(initiator, target):
    local = _local(initiator, 4096)
    _, rm = target.region(4096)
    assert initiator.write(local.desc, 0, rm, 0, 8, 1).WaitFor(10_000) == StatusCode.SUCCESS
    sess = initiator.create_session(local.desc, rm)
    target.call("deregister", rm.id)
    st = initiator.write(local.desc, 0, rm, 0, 8, 2)
    assert st.WaitFor(10_000) == StatusCode.ERR_NOT_FOUND, st.Message()
    initiator.deregister_memory(local.desc)
    st = initiator.write(local.desc, 0, rm, 0, 8, 3)
    assert st.Code() == StatusCode.ERR_NOT_FOUND and "not registered" in st.Message()
    assert sess.write(0, 0, 8, 4).Code() == StatusCode.ERR_NOT_FOUND
    initiator.deregister_memory(local.desc)  # idempotent


# --------------------------------------------------------- hostile frames
def _handshake(port: int, key: str = "evil") -> socket.socket:
    """Speak the control-plane handshake (no secret) and open a TCP data channel."""
    s, verdict = raw_handshake(port, key)
    assert verdict[:1] == b"\x01"
    return s


_header = request_header


def _dropped(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "frame",
    [
        b"\x00" * 100,  # garbage instead of a handshake
        None,  # handshake, then a bad magic
        "nseg",  # too many segments
        "total",  # oversized payload
        "sum",  # segment sizes do not add up
        "truncated",
    ],
    ids=["garbage", "bad-magic", "too-many-segments", "oversized", "bad-sum", "truncated"],
)
def test_malformed_frames_drop_the_connection_only(initiator, target, frame):
    port = target.desc.port
    if isinstance(frame, bytes):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(frame)
    else:
        s = _handshake(port)
        if frame is None:
            s.sendall(_header(magic=0xDEADBEEF))
        elif frame == "nseg":
            s.sendall(_header(nseg=1 << 20))
        elif frame == "total":
            s.sendall(_header(total=1 << 40))
        elif frame == "sum":
            s.sendall(_header(nseg=1, total=100) + struct.pack("<QQ", 0, 8))
        else:
            s.sendall(_header()[:20])
            s.close()
            s = None
    if s is not None:
        assert _dropped(s)
        s.close()
    # the engine keeps serving legitimate peers
    local = _local(initiator, 4096)
    local.array[:] = 9
    remote_buf, rm = target.region(4096)
    assert initiator.write(local.desc, 0, rm, 0, 4096, 77).WaitFor(10_000) == StatusCode.SUCCESS
    assert (np.frombuffer(remote_buf, dtype=np.uint8) == 9).all()


def test_refused_request_keeps_the_stream_usable(target):
    """A well-formed but refused write gets an error reply; the same socket then works."""
    remote_buf, rm = target.region(64)
    s = _handshake(target.desc.port, "raw-client")
    s.sendall(_header(mem=rm.id, total=8) + struct.pack("<QQ", 60, 8) + b"x" * 8)  # 60+8 > 64
    kind, code, req, _ = read_reply(s)
    assert kind == 3 and code == int(StatusCode.ERR_INVALID_ARGS)
    s.sendall(_header(mem=rm.id, total=8, req=2) + struct.pack("<QQ", 0, 8) + b"y" * 8)
    kind, code, req, _ = read_reply(s)
    assert kind == 1 and req == 2
    assert bytes(remote_buf[:8]) == b"y" * 8
    s.close()


# ------------------------------------------------------------- dead peers
def test_peer_killed_mid_transfer_fails_within_bound():
    victim = TargetProcess("victim")
    e = IOEngine("survivor", IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2, chunk_bytes=1 << 20))
    e.register_remote_engine(victim.desc)
    local = _local(e, 64 << 20)
    _, rm = victim.region(64 << 20)
    statuses = [e.write(local.desc, 0, rm, 0, 64 << 20, i) for i in range(40)]  # ~2.5 GiB queued
    time.sleep(0.05)
    victim.kill()
    t0 = time.monotonic()
    code = e.wait_all(statuses, 10_000)
    elapsed = time.monotonic() - t0
    assert code != StatusCode.IN_PROGRESS and code == StatusCode.ERR_BAD_STATE
    assert elapsed < 2.0, elapsed
    assert all(s.Succeeded() or s.Failed() for s in statuses)
    failed = [s for s in statuses if s.Failed()]
    assert failed and "failed" in failed[0].Message()
    # a transfer to the dead peer fails fast instead of hanging
    t0 = time.monotonic()
    assert e.write(local.desc, 0, rm, 0, 8, 99).WaitFor(5_000) == StatusCode.ERR_BAD_STATE
    assert time.monotonic() - t0 < 3.0
    victim.close()


def test_stalled_peer_times_out():
    """A peer that accepts but never answers ends the transfer after op_timeout_ms."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    # an engine descriptor pointing at the silent server
    real = IOEngine("silent", IOEngineConfig("127.0.0.1", 0))
    real.create_backend(BackendType.TCP)
    packed = bytearray(real.get_engine_desc().pack())
    pos = packed.rfind(struct.pack("<H", real.get_engine_desc().port))
    packed[pos:pos + 2] = struct.pack("<H", port)
    from mori_core.io import EngineDesc

    fake = EngineDesc.unpack(bytes(packed))
    assert fake.port == port
    mem = real.register_memory(_local(real, 4096).array.ctypes.data, 4096, -1, MemoryLocationType.CPU)
    e = IOEngine("impatient", IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=1, op_timeout_ms=300))
    e.register_remote_engine(fake)
    local = _local(e, 4096)
    t0 = time.monotonic()
    st = e.write(local.desc, 0, mem, 0, 8, 1)
    assert st.WaitFor(15_000) == StatusCode.ERR_BAD_STATE
    assert time.monotonic() - t0 < 10, "the handshake/op timeout must bound the wait"
    srv.close()


# ------------------------------------------------------------------- auth
@pytest.mark.parametrize(
    "target_secret,initiator_secret,ok",
    [("s3cret", "s3cret", True), ("s3cret", "", False), ("s3cret", "other", False), ("", "s3cret", False)],
    ids=["same", "initiator-missing", "different", "target-missing"],
)
def test_shared_secret(target_secret, initiator_secret, ok):
    t = TargetProcess(f"auth-target-{initiator_secret or 'none'}", secret=target_secret)
    try:
        e = IOEngine(f"auth-initiator-{target_secret or 'none'}", IOEngineConfig("127.0.0.1", 0, auth_secret=initiator_secret))
        e.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=1))
        e.register_remote_engine(t.desc)
        local = _local(e, 4096)
        local.array[:] = 3
        remote_buf, rm = t.region(4096)
        np.frombuffer(remote_buf, dtype=np.uint8)[:] = POISON
        st = e.write(local.desc, 0, rm, 0, 4096, 1)
        code = st.WaitFor(10_000)
        if ok:
            assert code == StatusCode.SUCCESS, st.Message()
            assert (np.frombuffer(remote_buf, dtype=np.uint8) == 3).all()
        else:
            assert code == StatusCode.ERR_BAD_STATE
            assert "authentication" in st.Message() or "secret" in st.Message() or "credentials" in st.Message()
            assert (np.frombuffer(remote_buf, dtype=np.uint8) == POISON).all()
    finally:
        t.close()
