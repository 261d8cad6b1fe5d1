"""Target-side notifications (pop_inbound_transfer_status) and wait_all semantics."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mori_core.io import StatusCode, TransferStatus, wait_all

from io_peer import LocalBuffer, TargetProcess


def test_notification_after_write(initiator, target):
    local = LocalBuffer(initiator, 16 << 20)
    _, rm = target.region(16 << 20)
    uid = initiator.allocate_transfer_uid()
    assert target.pop("initiator", uid) is None  # nothing arrived yet
    st = initiator.write(local.desc, 0, rm, 0, 16 << 20, uid)  # several frames
    assert st.WaitFor(20_000) == StatusCode.SUCCESS
    # recorded before the initiator saw SUCCESS: no polling needed
    assert target.pop("initiator", uid) == int(StatusCode.SUCCESS)
    assert target.pop("initiator", uid) is None  # reported exactly once
    assert target.pop("someone-else", uid) is None  # keyed by the initiator's engine key


def test_notification_for_batch_and_session(initiator, target):
    local = LocalBuffer(initiator, 1 << 20)
    _, rm = target.region(1 << 20)
    sess = initiator.create_session(local.desc, rm)
    uid = sess.allocate_transfer_uid()
    st = sess.batch_write([0, 8192, 65536], [4096, 0, 500000], [100, 200, 300], uid)
    assert st.WaitFor(20_000) == StatusCode.SUCCESS
    assert target.pop("initiator", uid) == int(StatusCode.SUCCESS)


def test_failed_transfer_is_not_notified(initiator, target):
    local = LocalBuffer(initiator, 4096)
    _, rm = target.region(4096)
    uid = initiator.allocate_transfer_uid()
    st = initiator.write(local.desc, 0, rm, 4000, 200, uid)
    assert st.Failed() and st.Code() == StatusCode.ERR_INVALID_ARGS
    assert target.pop("initiator", uid) is None


def test_notifications_disabled():
    from mori_core.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig

    t = TargetProcess("target-nonotif")
    try:
        e = IOEngine("initiator-nonotif", IOEngineConfig("127.0.0.1", 0))
        e.create_backend(BackendType.TCP, TcpBackendConfig(enable_notification=False))
        e.register_remote_engine(t.desc)
        local = LocalBuffer(e, 4096)
        _, rm = t.region(4096)
        uid = e.allocate_transfer_uid()
        assert e.write(local.desc, 0, rm, 0, 4096, uid).WaitFor(20_000) == StatusCode.SUCCESS
        assert t.pop("initiator-nonotif", uid) is None
    finally:
        t.close()


def test_wait_all_semantics():
    ok = TransferStatus()
    ok.Update(StatusCode.SUCCESS)
    pending = TransferStatus()
    pending.Update(StatusCode.IN_PROGRESS)
    bad = TransferStatus()
    bad.Update(StatusCode.ERR_NOT_FOUND, "gone")
    assert wait_all([], 0) == StatusCode.SUCCESS
    assert wait_all([ok, ok], 10) == StatusCode.SUCCESS
    t0 = time.monotonic()
    assert wait_all([ok, pending], 200) == StatusCode.IN_PROGRESS
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert wait_all([ok, bad, pending], 50) == StatusCode.ERR_NOT_FOUND  # failure wins


def test_first_error_wins():
    s = TransferStatus()
    assert s.Init()
    s.Update(StatusCode.IN_PROGRESS)
    s.Update(StatusCode.ERR_INVALID_ARGS, "first")
    s.Update(StatusCode.ERR_BAD_STATE, "second")
    s.Update(StatusCode.SUCCESS)
    assert s.Code() == StatusCode.ERR_INVALID_ARGS and s.Message() == "first" and s.Failed()


def test_wait_releases_the_gil():
    """A thread blocked in WaitFor must not stop Python code in other threads."""
    import threading

    s = TransferStatus()
    s.Update(StatusCode.IN_PROGRESS)
    t = threading.Thread(target=lambda: s.WaitFor(5000))
    t.start()
    t0 = time.monotonic()
    counted = sum(1 for _ in range(200000))  # pure Python work while the waiter blocks
    s.Update(StatusCode.SUCCESS)
    t.join(5)
    assert counted == 200000 and not t.is_alive() and time.monotonic() - t0 < 5
