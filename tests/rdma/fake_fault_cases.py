"""Failure handling of the RDMA backend, driven through the software verbs
provider's fault knobs (tests/rdma/fake_verbs). Not collected directly (the
name does not start with test_): test_rdma_fake_provider.py runs this file in
a subprocess with MORI_IBVERBS_LIBRARY pointing at the fake library.

What is checked: a failed work request fails exactly the transfers it
belonged to, with a message naming the cause and the knob; the connection is
rebuilt on the next transfer; every wait is bounded (lost completions, full
send queues, removed backends, dead peers); notifications work without inline
sends; the InfiniBand (LID) path connects; peers without RDMA get TCP.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from typing import Iterator

import numpy as np
import pytest

from mori_core.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryLocationType,
    RdmaBackendConfig,
    StatusCode,
)

assert os.environ.get("MORI_IBVERBS_LIBRARY", "").endswith("libfakeverbs.so"), "run through test_rdma_fake_provider.py"

BUF = 1 << 20
WAIT_MS = 15000


class Side:
    def __init__(self, key: str, backends: tuple[BackendType, ...], config: RdmaBackendConfig | None = None,
                 secret: str = "") -> None:
        self.engine = IOEngine(key, IOEngineConfig("127.0.0.1", 0, auth_secret=secret))
        for b in backends:
            self.engine.create_backend(b, config if b == BackendType.RDMA else None)
        self.buf = np.zeros(BUF, dtype=np.uint8)
        self.mem = self.engine.register_memory(self.buf.ctypes.data, BUF, -1, MemoryLocationType.CPU)


def cfg(max_send_wr: int = 0, **kw: object) -> RdmaBackendConfig:
    """RdmaBackendConfig with the attributes MORI's constructor does not take."""
    c = RdmaBackendConfig(**kw)
    c.max_send_wr = max_send_wr
    return c


def connect(config: RdmaBackendConfig | None = None, target_backends: tuple[BackendType, ...] = (BackendType.RDMA,),
            initiator_backends: tuple[BackendType, ...] = (BackendType.RDMA,)) -> tuple[Side, Side]:
    a = Side("init", initiator_backends, config)
    b = Side("tgt", target_backends, config)
    a.engine.register_remote_engine(b.engine.get_engine_desc())
    b.engine.register_remote_engine(a.engine.get_engine_desc())
    return a, b


_FAKE = ctypes.CDLL(os.environ["MORI_IBVERBS_LIBRARY"])  # the same instance the backend loaded
COUNTERS = ("posted", "signaled", "inline", "fenced", "writes", "reads", "sends", "post_calls")


def counters() -> dict[str, int]:
    out = (ctypes.c_long * len(COUNTERS))()
    _FAKE.fake_verbs_counters(out)
    return dict(zip(COUNTERS, out))


def inbound(b: Side, uid: int, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if b.engine.pop_inbound_transfer_status("init", uid) is not None:
            return True
        time.sleep(0.001)
    return False


@pytest.fixture(autouse=True)
def no_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k in ("FAKE_VERBS_FAIL_WRITE_AT", "FAKE_VERBS_DROP_COMPLETIONS", "FAKE_VERBS_NO_INLINE", "FAKE_VERBS_LINK_LAYER"):
        monkeypatch.delenv(k, raising=False)
    yield
    gc.collect()


@pytest.mark.parametrize("op", ["write", "read"])
def test_chains_are_signalled_once_and_notifications_follow_the_data(op: str) -> None:
    # 20 WRs that cannot merge (remote gaps), batches of 4 over 2 QPs:
    # 5 chains -> 5 signalled WRs and 5 doorbells, plus one notification per
    # QP used (inline; fenced behind the data for reads).
    a, b = connect(RdmaBackendConfig(qp_per_transfer=2, post_batch_size=4))
    offs = [i * 4096 for i in range(20)]
    fn = a.engine.batch_read if op == "read" else a.engine.batch_write
    _FAKE.fake_verbs_reset_counters()
    uid = a.engine.allocate_transfer_uid()
    s = fn([a.mem], [offs], [b.mem], [offs], [[1024] * 20], [uid])[0]
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS, s.Message()
    c = counters()
    data = c["reads"] if op == "read" else c["writes"]
    assert (data, c["sends"], c["posted"]) == (20, 2, 22), c
    assert c["signaled"] == 5 + 2 and c["post_calls"] == 5 + 2, c
    assert c["inline"] == 2 and c["fenced"] == (2 if op == "read" else 0), c
    assert inbound(b, uid)


def test_contiguous_pages_are_merged_before_posting() -> None:
    a, b = connect(RdmaBackendConfig(qp_per_transfer=4))
    offs = [i * 4096 for i in range(64)]
    _FAKE.fake_verbs_reset_counters()
    s = a.engine.batch_write([a.mem], [offs[::-1]], [b.mem], [offs[::-1]], [[4096] * 64], [1])[0]
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS
    assert counters()["writes"] == 1  # 64 adjacent pages, one work request


def test_a_failed_write_fails_exactly_its_transfer_then_the_connection_is_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = connect(RdmaBackendConfig())
    a.buf[:] = np.arange(BUF, dtype=np.uint64).view(np.uint8)[:BUF]
    monkeypatch.setenv("FAKE_VERBS_FAIL_WRITE_AT", "2@rebuild")
    uids = [a.engine.allocate_transfer_uid() for _ in range(3)]
    s1 = a.engine.write(a.mem, 0, b.mem, 0, 4096, uids[0])
    assert s1.WaitFor(WAIT_MS) == StatusCode.SUCCESS
    s2 = a.engine.write(a.mem, 4096, b.mem, 4096, 4096, uids[1])
    assert s2.WaitFor(WAIT_MS) == StatusCode.ERR_RDMA_OP
    msg = s2.Message()
    assert "transport retry counter exceeded" in msg and "MORI_IO_QP_TIMEOUT" in msg and "engine 'tgt'" in msg
    # Only the bytes of the successful transfers landed; the failed one is not announced.
    assert np.array_equal(b.buf[:4096], a.buf[:4096]) and not b.buf[4096:8192].any()
    assert inbound(b, uids[0]) and not inbound(b, uids[1], 0.2)
    # The next transfer rebuilds the queue pairs and succeeds.
    s3 = a.engine.write(a.mem, 4096, b.mem, 4096, 4096, uids[2])
    assert s3.WaitFor(WAIT_MS) == StatusCode.SUCCESS, s3.Message()
    assert np.array_equal(b.buf[:8192], a.buf[:8192]) and inbound(b, uids[2])


def test_with_several_qps_only_the_transfer_on_the_failed_qp_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = connect(RdmaBackendConfig(qp_per_transfer=4))
    a.buf[:] = 9
    sess = a.engine.create_session(a.mem, b.mem)
    monkeypatch.setenv("FAKE_VERBS_FAIL_WRITE_AT", "2@multi-qp")
    uids = [a.engine.allocate_transfer_uid() for _ in range(4)]  # consecutive uids start on different QPs
    statuses = [sess.write(i * 4096, i * 4096, 4096, u) for i, u in enumerate(uids)]
    codes = [s.WaitFor(WAIT_MS) for s in statuses]
    assert codes == [StatusCode.SUCCESS, StatusCode.ERR_RDMA_OP, StatusCode.SUCCESS, StatusCode.SUCCESS], \
        [s.Message() for s in statuses]
    assert [inbound(b, u, 0.5) for u in uids] == [True, False, True, True]
    assert b.buf[:4096].all() and not b.buf[4096:8192].any() and b.buf[8192:16384].all()
    # The session rebuilds its route on the next transfer.
    s = sess.write(4096, 4096, 4096, a.engine.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS, s.Message()
    assert b.buf[4096:8192].all() and sess.alive()


def test_a_lost_completion_is_bounded_by_the_stall_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_IO_QP_STALL_TIMEOUT_MS", "300")
    a, b = connect(RdmaBackendConfig())
    monkeypatch.setenv("FAKE_VERBS_DROP_COMPLETIONS", "1")
    t0 = time.monotonic()
    s = a.engine.write(a.mem, 0, b.mem, 0, 4096, a.engine.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.ERR_RDMA_OP
    assert time.monotonic() - t0 < 5
    assert "MORI_IO_QP_STALL_TIMEOUT_MS" in s.Message(), s.Message()
    monkeypatch.delenv("FAKE_VERBS_DROP_COMPLETIONS")
    s = a.engine.write(a.mem, 0, b.mem, 0, 4096, a.engine.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS, s.Message()


def test_a_small_send_queue_recycles_its_slots() -> None:
    # 300 separate WRs through a 16-slot send queue: only completions free slots,
    # and the fake refuses (ENOMEM) any post beyond the depth.
    a, b = connect(cfg(qp_per_transfer=2, post_batch_size=4, max_send_wr=16))
    a.buf[:] = np.random.default_rng(0).integers(0, 256, BUF, dtype=np.uint8)
    offs = [i * 2048 for i in range(300)]
    uid = a.engine.allocate_transfer_uid()
    s = a.engine.batch_write([a.mem], [offs], [b.mem], [offs], [[1024] * 300], [uid])[0]
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS, s.Message()
    for o in offs:
        assert np.array_equal(b.buf[o : o + 1024], a.buf[o : o + 1024])
    assert not b.buf[1024:2048].any()
    assert inbound(b, uid)


def test_a_full_send_queue_fails_after_the_backoff_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_IO_SQ_BACKOFF_TIMEOUT_US", "200000")
    monkeypatch.setenv("MORI_IO_QP_STALL_TIMEOUT_MS", "1000")
    a, b = connect(cfg(post_batch_size=15, max_send_wr=16))
    monkeypatch.setenv("FAKE_VERBS_DROP_COMPLETIONS", "1")
    offs = [i * 2048 for i in range(30)]
    t0 = time.monotonic()
    s = a.engine.batch_write([a.mem], [offs], [b.mem], [offs], [[1024] * 30], [a.engine.allocate_transfer_uid()])[0]
    assert s.WaitFor(WAIT_MS) == StatusCode.ERR_RDMA_OP
    assert time.monotonic() - t0 < 6
    assert "send queue stayed full" in s.Message() and "max_send_wr" in s.Message(), s.Message()


def test_notifications_without_inline_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VERBS_NO_INLINE", "1")
    a, b = connect(RdmaBackendConfig(qp_per_transfer=2))
    uids = [a.engine.allocate_transfer_uid() for _ in range(50)]
    statuses = [a.engine.write(a.mem, 0, b.mem, 0, 64, u) for u in uids]
    assert a.engine.wait_all(statuses, WAIT_MS) == StatusCode.SUCCESS
    assert all(inbound(b, u) for u in uids)


def test_removing_the_backend_ends_transfers_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_IO_QP_STALL_TIMEOUT_MS", "0")  # nothing but the removal can end it
    a, b = connect(RdmaBackendConfig())
    monkeypatch.setenv("FAKE_VERBS_DROP_COMPLETIONS", "1")
    s = a.engine.write(a.mem, 0, b.mem, 0, 4096, a.engine.allocate_transfer_uid())
    assert s.WaitFor(200) == StatusCode.IN_PROGRESS
    t0 = time.monotonic()
    a.engine.remove_backend(BackendType.RDMA)
    assert s.WaitFor(WAIT_MS) == StatusCode.ERR_BAD_STATE and "aborted" in s.Message()
    assert time.monotonic() - t0 < 5


def test_a_dead_peer_fails_transfers_in_bounded_time() -> None:
    a, b = connect(RdmaBackendConfig())
    s = a.engine.write(a.mem, 0, b.mem, 0, 4096, a.engine.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS
    mem = b.mem
    del b
    gc.collect()
    for _ in range(2):  # the first fails on the old QPs, the second at reconnection
        t0 = time.monotonic()
        s = a.engine.write(a.mem, 0, mem, 0, 4096, a.engine.allocate_transfer_uid())
        code = s.WaitFor(WAIT_MS)
        assert code in (StatusCode.ERR_RDMA_OP, StatusCode.ERR_BAD_STATE), (code, s.Message())
        assert time.monotonic() - t0 < 10


def test_infiniband_link_layer_connects_by_lid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VERBS_LINK_LAYER", "ib")
    a, b = connect(RdmaBackendConfig())
    a.buf[:4096] = 5
    s = a.engine.write(a.mem, 0, b.mem, 0, 4096, a.engine.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS, s.Message()
    assert (b.buf[:4096] == 5).all()
    del a, b
    gc.collect()


def test_a_peer_without_rdma_is_reached_over_tcp() -> None:
    a, b = connect(target_backends=(BackendType.TCP,), initiator_backends=(BackendType.RDMA, BackendType.TCP))
    assert a.engine.route_of(a.mem, b.mem) == BackendType.TCP
    a.buf[:100] = 3
    s = a.engine.write(a.mem, 0, b.mem, 0, 100, a.engine.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS and (b.buf[:100] == 3).all()


def test_an_rdma_only_initiator_reports_a_peer_without_rdma() -> None:
    a, b = connect(target_backends=(BackendType.TCP,))
    s = a.engine.write(a.mem, 0, b.mem, 0, 100, a.engine.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.ERR_BAD_STATE and "no available backend" in s.Message()


def test_deregistered_local_memory_ends_session_transfers() -> None:
    a, b = connect(RdmaBackendConfig())
    sess = a.engine.create_session(a.mem, b.mem)
    assert sess.write(0, 0, 64, a.engine.allocate_transfer_uid()).WaitFor(WAIT_MS) == StatusCode.SUCCESS
    a.engine.deregister_memory(a.mem)
    s = sess.write(0, 0, 64, a.engine.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.ERR_NOT_FOUND and "deregistered" in s.Message()


def test_authenticated_control_plane() -> None:
    a = Side("init", (BackendType.RDMA,), secret="s3cret")
    b = Side("tgt", (BackendType.RDMA,), secret="s3cret")
    c = Side("intruder", (BackendType.RDMA,), secret="wrong")
    for x in (a, c):
        x.engine.register_remote_engine(b.engine.get_engine_desc())
    assert a.engine.write(a.mem, 0, b.mem, 0, 64, 1).WaitFor(WAIT_MS) == StatusCode.SUCCESS
    s = c.engine.write(c.mem, 0, b.mem, 0, 64, 1)
    assert s.WaitFor(WAIT_MS) == StatusCode.ERR_BAD_STATE  # refused at the handshake: no route
