"""Byte-exact transfers between two engines in two processes over the TCP backend.

{read, write} x {engine, session} x {single, batch} x sizes {1 B, 8 KiB, 4 MiB},
plus batches of 64 scattered segments. Destinations are poisoned first so a
transfer that does nothing cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest

from io_peer import LocalBuffer

from mori_core.io import StatusCode

POISON = 0xA5
SIZES = [1, 8192, 4 << 20]


def _submit(initiator, session, op, api, shape, lm, rm, offs_l, offs_r, size):
    uid = initiator.allocate_transfer_uid()
    read = op == "read"
    if api == "session":
        if shape == "single":
            f = session.read if read else session.write
            return [f(offs_l[i], offs_r[i], size, uid if i == 0 else initiator.allocate_transfer_uid()) for i in range(len(offs_l))], uid
        f = session.batch_read if read else session.batch_write
        return [f(offs_l, offs_r, [size] * len(offs_l), uid)], uid
    if shape == "single":
        f = initiator.read if read else initiator.write
        return [f(lm, offs_l[i], rm, offs_r[i], size, uid if i == 0 else initiator.allocate_transfer_uid()) for i in range(len(offs_l))], uid
    f = initiator.batch_read if read else initiator.batch_write
    return f([lm], [offs_l], [rm], [offs_r], [[size] * len(offs_l)], [uid]), uid


@pytest.mark.parametrize("size", SIZES, ids=["1B", "8KiB", "4MiB"])
@pytest.mark.parametrize("shape", ["single", "batch"])
@pytest.mark.parametrize("api", ["engine", "session"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_matrix(initiator, target, rng, op, api, shape, size):
    count = 1 if shape == "single" else 4
    span = count * size * 2 + 64
    local = LocalBuffer(initiator, span)
    remote_buf, rm = target.region(span)
    # scattered, non-contiguous segments at different offsets on each side
    offs_l = [16 + i * 2 * size for i in range(count)]
    offs_r = [32 + i * 2 * size for i in range(count)][::-1] if span >= 32 + count * 2 * size else [i * 2 * size for i in range(count)]
    payload = rng.integers(0, 256, span, dtype=np.uint8)
    src, dst = (np.frombuffer(remote_buf, dtype=np.uint8), local.array) if op == "read" else (local.array, np.frombuffer(remote_buf, dtype=np.uint8))
    src[:] = payload
    dst[:] = POISON
    session = initiator.create_session(local.desc, rm) if api == "session" else None
    if api == "session":
        assert session is not None and session.alive()
    statuses, uid = _submit(initiator, session, op, api, shape, local.desc, rm, offs_l, offs_r, size)
    assert initiator.wait_all(statuses, 20_000) == StatusCode.SUCCESS, [s.Message() for s in statuses]
    assert all(s.Succeeded() for s in statuses)
    expected = np.full(span, POISON, dtype=np.uint8)
    so, do = (offs_r, offs_l) if op == "read" else (offs_l, offs_r)
    for s_off, d_off in zip(so, do):
        expected[d_off:d_off + size] = payload[s_off:s_off + size]
    np.testing.assert_array_equal(dst, expected)
    initiator.deregister_memory(local.desc)


def test_batch_of_64_scattered_pages(initiator, target, rng):
    page, n = 8192, 64
    local = LocalBuffer(initiator, 2 * n * page)
    remote_buf, rm = target.region(2 * n * page)
    perm = rng.permutation(2 * n)[:n]  # remote pages in random order, with gaps
    offs_l = [i * 2 * page for i in range(n)]
    offs_r = [int(p) * page for p in perm]
    local.array[:] = rng.integers(0, 256, local.array.size, dtype=np.uint8)
    remote = np.frombuffer(remote_buf, dtype=np.uint8)
    remote[:] = POISON
    session = initiator.create_session(local.desc, rm)
    st = session.batch_write(offs_l, offs_r, [page] * n, session.allocate_transfer_uid())
    assert st.WaitFor(20_000) == StatusCode.SUCCESS, st.Message()
    for lo, ro in zip(offs_l, offs_r):
        np.testing.assert_array_equal(remote[ro:ro + page], local.array[lo:lo + page])
    untouched = np.ones(remote.size, bool)
    for ro in offs_r:
        untouched[ro:ro + page] = False
    assert (remote[untouched] == POISON).all()
    # and read them back into a poisoned local buffer
    local.array[:] = POISON
    st = session.batch_read(offs_l, offs_r, [page] * n, session.allocate_transfer_uid())
    assert st.WaitFor(20_000) == StatusCode.SUCCESS, st.Message()
    for lo, ro in zip(offs_l, offs_r):
        np.testing.assert_array_equal(local.array[lo:lo + page], remote[ro:ro + page])


def test_contiguous_segments_are_merged_and_exact(initiator, target, rng):
    """Many adjacent small segments (merged into one) land byte-exact."""
    n, seg = 1000, 100
    local = LocalBuffer(initiator, n * seg)
    remote_buf, rm = target.region(n * seg)
    local.array[:] = rng.integers(0, 256, n * seg, dtype=np.uint8)
    remote = np.frombuffer(remote_buf, dtype=np.uint8)
    remote[:] = POISON
    offs = [i * seg for i in range(n)]
    st = initiator.batch_write([local.desc], [offs], [rm], [offs], [[seg] * n], [initiator.allocate_transfer_uid()])[0]
    assert st.WaitFor(20_000) == StatusCode.SUCCESS, st.Message()
    np.testing.assert_array_equal(remote, local.array)


def test_many_back_to_back_transfers(initiator, target, rng):
    """500 interleaved single writes from one thread all land, each exactly once."""
    n, seg = 500, 256
    local = LocalBuffer(initiator, n * seg)
    remote_buf, rm = target.region(n * seg)
    local.array[:] = rng.integers(0, 256, n * seg, dtype=np.uint8)
    remote = np.frombuffer(remote_buf, dtype=np.uint8)
    remote[:] = POISON
    statuses = [initiator.write(local.desc, i * seg, rm, (n - 1 - i) * seg, seg, initiator.allocate_transfer_uid()) for i in range(n)]
    assert initiator.wait_all(statuses, 30_000) == StatusCode.SUCCESS
    for i in range(n):
        np.testing.assert_array_equal(remote[(n - 1 - i) * seg:(n - i) * seg], local.array[i * seg:(i + 1) * seg])
