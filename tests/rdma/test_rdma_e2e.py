"""End-to-end RDMA transfers between two engines of this process (RC QPs over
the NIC's loopback), the same matrix as the TCP backend:
{read, write} x {engine, session} x {single, batch}, over several backend
configurations, plus notifications, out-of-bounds and error cases.

Skips with the reason when create_backend(BackendType.RDMA) fails here (no
libibverbs, no device). tests/rdma/test_rdma_fake_provider.py runs this very
file against the software verbs provider, so CI exercises it without a NIC;
on a machine with a NIC it runs against the hardware.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from mori_core.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
)
from rdma_helpers import rdma_available

_OK, _WHY = rdma_available()
pytestmark = [pytest.mark.rdma]
if not _OK:
    pytestmark.append(pytest.mark.skip(reason=f"no usable RDMA device here: {_WHY}"))

BUF = 1 << 20
PAGE = 8192
WAIT_MS = 15000
NOTIFY_WAIT_S = 5.0

CONFIGS: dict[str, Callable[[], RdmaBackendConfig]] = {
    "default": lambda: RdmaBackendConfig(),
    "multi_qp": lambda: RdmaBackendConfig(qp_per_transfer=4, post_batch_size=2),
    "workers": lambda: RdmaBackendConfig(qp_per_transfer=4, num_worker_threads=2),
    "event": lambda: RdmaBackendConfig(qp_per_transfer=2, poll_cq_mode=PollCqMode.EVENT),
    "chunked": lambda: RdmaBackendConfig(qp_per_transfer=3, enable_transfer_chunking=True, chunk_bytes=4096),
    "no_notif": lambda: RdmaBackendConfig(enable_notification=False),
}


class Buffer:
    """Registered memory of one engine: a host array or (gpu) a CUDA tensor."""

    def __init__(self, engine: IOEngine, size: int, kind: str, device: int = 0) -> None:
        self.kind = kind
        if kind == "cpu":
            self.array = np.zeros(size, dtype=np.uint8)
            self.desc = engine.register_memory(self.array.ctypes.data, size, -1, MemoryLocationType.CPU)
        else:
            import torch

            self.tensor = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{device}")
            self.desc = engine.register_torch_tensor(self.tensor)

    def get(self) -> np.ndarray:
        if self.kind == "cpu":
            return self.array.copy()
        import torch

        torch.cuda.synchronize()
        return self.tensor.cpu().numpy()

    def set(self, data: np.ndarray) -> None:
        if self.kind == "cpu":
            self.array[:] = data
        else:
            import torch

            self.tensor.copy_(torch.from_numpy(data))
            torch.cuda.synchronize()


@dataclass
class Pair:
    initiator: IOEngine
    target: IOEngine
    local: Buffer
    remote: Buffer
    notify: bool


def make_pair(name: str, config: RdmaBackendConfig, kind: str) -> Pair:
    a = IOEngine(f"{name}-init", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine(f"{name}-tgt", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(BackendType.RDMA, config)
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    devices = (0, 1) if kind == "gpu" and _gpu_count() > 1 else (0, 0)
    return Pair(a, b, Buffer(a, BUF, kind, devices[0]), Buffer(b, BUF, kind, devices[1]), config.enable_notification)


def _gpu_count() -> int:
    try:
        from mori_core import _C

        return int(_C.gpu_device_count())
    except Exception:
        return 0


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def config_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def mem_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def pair(config_name: str, mem_kind: str) -> Iterator[Pair]:
    p = make_pair(f"{config_name}-{mem_kind}", CONFIGS[config_name](), mem_kind)
    yield p
    del p


def wait_inbound(target: IOEngine, initiator_key: str, uid: int, timeout_s: float = NOTIFY_WAIT_S) -> TransferStatus | None:
    """Polls the target's inbound record (RDMA notifications land asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = target.pop_inbound_transfer_status(initiator_key, uid)
        if s is not None or time.monotonic() > deadline:
            return s
        time.sleep(0.001)


def pages(rng: random.Random, n: int, size: int) -> tuple[list[int], list[int], list[int]]:
    """n scattered, shuffled page-sized segments (different local and remote places);
    the last page stays free for the tiny tail segment, so no destination byte is written twice."""
    slots = BUF // size - 1
    lo = rng.sample(range(slots), n)
    ro = rng.sample(range(slots), n)
    return [i * size for i in lo], [i * size for i in ro], [size] * n


def run_transfer(p: Pair, op: str, api: str, shape: str, uid: int, rng: random.Random) -> tuple[TransferStatus, Any]:
    a, la, rb = p.initiator, p.local.desc, p.remote.desc
    if shape == "single":
        lo, ro, sz = [rng.randrange(0, BUF // 2)], [rng.randrange(0, BUF // 2)], [rng.randrange(1, BUF // 2)]
    else:
        lo, ro, sz = pages(rng, 64, PAGE)
        lo.append(BUF - 8)  # plus a tiny one at the very end of both regions
        ro.append(BUF - 8)
        sz.append(8)
    if api == "engine":
        if shape == "single":
            fn = a.read if op == "read" else a.write
            status = fn(la, lo[0], rb, ro[0], sz[0], uid)
        else:
            fn = a.batch_read if op == "read" else a.batch_write
            status = fn([la], [lo], [rb], [ro], [sz], [uid])[0]
    else:
        sess = a.create_session(la, rb)
        assert sess is not None
        if shape == "single":
            fn = sess.read if op == "read" else sess.write
            status = fn(lo[0], ro[0], sz[0], uid)
        else:
            fn = sess.batch_read if op == "read" else sess.batch_write
            status = fn(lo, ro, sz, uid)
    return status, (lo, ro, sz)


@pytest.mark.parametrize("shape", ["single", "batch"])
@pytest.mark.parametrize("api", ["engine", "session"])
@pytest.mark.parametrize("op", ["read", "write"])
def test_matrix(pair: Pair, op: str, api: str, shape: str) -> None:
    rng = random.Random(hash((op, api, shape)) & 0xFFFF)
    src_buf, dst_buf = (pair.remote, pair.local) if op == "read" else (pair.local, pair.remote)
    src = np.frombuffer(rng.randbytes(BUF), dtype=np.uint8).copy()
    src_buf.set(src)
    dst_buf.set(np.zeros(BUF, dtype=np.uint8))
    uid = pair.initiator.allocate_transfer_uid()
    status, (lo, ro, sz) = run_transfer(pair, op, api, shape, uid, rng)
    assert status.WaitFor(WAIT_MS) == StatusCode.SUCCESS, status.Message()
    assert status.Succeeded()

    expected = np.zeros(BUF, dtype=np.uint8)
    for l, r, n in zip(lo, ro, sz):
        s_off, d_off = (r, l) if op == "read" else (l, r)
        expected[d_off : d_off + n] = src[s_off : s_off + n]
    got = dst_buf.get()
    assert np.array_equal(got, expected)
    assert got.any(), "the destination did not change"

    inbound = wait_inbound(pair.target, pair.initiator.key, uid, NOTIFY_WAIT_S if pair.notify else 0.05)
    if pair.notify:
        assert inbound is not None and inbound.Succeeded(), "the target never saw the transfer's notification"
        assert pair.target.pop_inbound_transfer_status(pair.initiator.key, uid) is None  # reported once
    else:
        assert inbound is None


def test_many_transfers_in_flight(pair: Pair) -> None:
    rng = random.Random(3)
    src = np.frombuffer(rng.randbytes(BUF), dtype=np.uint8).copy()
    pair.local.set(src)
    pair.remote.set(np.zeros(BUF, dtype=np.uint8))
    chunk = BUF // 32
    uids = [pair.initiator.allocate_transfer_uid() for _ in range(32)]
    statuses = [pair.initiator.write(pair.local.desc, i * chunk, pair.remote.desc, i * chunk, chunk, u)
                for i, u in enumerate(uids)]
    assert pair.initiator.wait_all(statuses, WAIT_MS) == StatusCode.SUCCESS, [s.Message() for s in statuses]
    assert np.array_equal(pair.remote.get(), src)
    if pair.notify:
        for u in uids:
            assert wait_inbound(pair.target, pair.initiator.key, u) is not None


def test_out_of_bounds_is_refused_and_writes_nothing(pair: Pair) -> None:
    pair.local.set(np.full(BUF, 7, dtype=np.uint8))
    pair.remote.set(np.zeros(BUF, dtype=np.uint8))
    a, la, rb = pair.initiator, pair.local.desc, pair.remote.desc
    uid = a.allocate_transfer_uid()
    s = a.batch_write([la], [[0, 4096]], [rb], [[0, BUF - 100]], [[4096, 4096]], [uid])[0]
    assert s.WaitFor(WAIT_MS) == StatusCode.ERR_INVALID_ARGS and "exceeds" in s.Message()
    sess = a.create_session(la, rb)
    s = sess.write(BUF - 10, 0, 11, a.allocate_transfer_uid())
    assert s.Code() == StatusCode.ERR_INVALID_ARGS
    s = a.read(la, 0, rb, BUF, 1, a.allocate_transfer_uid())
    assert s.Code() == StatusCode.ERR_INVALID_ARGS
    time.sleep(0.05)
    assert not pair.remote.get().any(), "a refused transfer wrote bytes"
    assert pair.target.pop_inbound_transfer_status(a.key, uid) is None


def test_unknown_inbound_is_none(pair: Pair) -> None:
    assert pair.target.pop_inbound_transfer_status(pair.initiator.key, 10**12) is None
    assert pair.target.pop_inbound_transfer_status("nobody", 1) is None


def test_session_is_alive_and_routes_to_rdma(pair: Pair) -> None:
    sess = pair.initiator.create_session(pair.local.desc, pair.remote.desc)
    assert sess is not None and sess.alive()
    assert pair.initiator.route_of(pair.local.desc, pair.remote.desc) == BackendType.RDMA


def test_deregistered_remote_memory_fails_cleanly(mem_kind: str) -> None:
    p = make_pair(f"dereg-{mem_kind}", RdmaBackendConfig(), mem_kind)
    a = p.initiator
    s = a.write(p.local.desc, 0, p.remote.desc, 0, 4096, a.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS, s.Message()  # rkey now cached
    p.target.deregister_memory(p.remote.desc)
    s = a.write(p.local.desc, 0, p.remote.desc, 0, 4096, a.allocate_transfer_uid())
    code = s.WaitFor(WAIT_MS)
    assert code in (StatusCode.ERR_RDMA_OP, StatusCode.ERR_NOT_FOUND), (code, s.Message())
    assert "deregistered" in s.Message() or "not registered" in s.Message()
    # The next attempt re-fetches the descriptor and gets a definite answer.
    s = a.write(p.local.desc, 0, p.remote.desc, 0, 4096, a.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.ERR_NOT_FOUND and "not registered" in s.Message()
    # Other memory of the same peer still works over a rebuilt connection.
    other = Buffer(p.target, BUF, mem_kind)
    s = a.write(p.local.desc, 0, other.desc, 0, 4096, a.allocate_transfer_uid())
    assert s.WaitFor(WAIT_MS) == StatusCode.SUCCESS, s.Message()
