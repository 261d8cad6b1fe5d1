"""Offsets and sizes of batches: lists, tuples, numpy arrays, other iterables, and the
errors for bad ones (raised before anything is submitted, naming the argument)."""

from __future__ import annotations

import array
import re

import numpy as np
import pytest

from io_peer import LocalBuffer

from mori_core import _C
from mori_core.io import StatusCode

POISON = 0x5A


def _pair(initiator, target, size=1 << 16):
    local = LocalBuffer(initiator, size)
    remote_buf, rm = target.region(size)
    remote = np.frombuffer(remote_buf, dtype=np.uint8)
    return local, rm, remote


CONTAINERS = {
    "list": lambda v: list(v),
    "tuple": lambda v: tuple(v),
    "int64": lambda v: np.asarray(v, dtype=np.int64),
    "uint64": lambda v: np.asarray(v, dtype=np.uint64),
    "int32": lambda v: np.asarray(v, dtype=np.int32),
    "uint16": lambda v: np.asarray(v, dtype=np.uint16),
    "array.array": lambda v: array.array("q", v),
    "range-like": lambda v: iter(list(v)),
    "numpy ints in a list": lambda v: [np.int64(x) for x in v],
}


@pytest.mark.parametrize("kind", list(CONTAINERS))
@pytest.mark.parametrize("api", ["session", "engine"])
def test_batch_write_accepts_containers(initiator, target, rng, kind, api):
    local, rm, remote = _pair(initiator, target)
    payload = rng.integers(0, 256, local.array.size, dtype=np.uint8)
    local.array[:] = payload
    remote[:] = POISON
    lo, ro, sz = [0, 5000, 20000], [30000, 100, 9000], [700, 1200, 64]
    make = CONTAINERS[kind]
    if api == "session":
        st = initiator.create_session(local.desc, rm).batch_write(make(lo), make(ro), make(sz), 7)
    else:
        uids = [7] if kind == "range-like" else make([7])  # the outer lists need a length
        st = initiator.batch_write([local.desc], [make(lo)], [rm], [make(ro)], [make(sz)], uids)[0]
    assert st.WaitFor(20_000) == StatusCode.SUCCESS, st.Message()
    expected = np.full(remote.size, POISON, dtype=np.uint8)
    for a, b, n in zip(lo, ro, sz):
        expected[b:b + n] = payload[a:a + n]
    np.testing.assert_array_equal(remote, expected)
    initiator.deregister_memory(local.desc)


def test_batch_read_with_numpy_views(initiator, target, rng):
    """A strided view is refused by name; its contiguous copy works."""
    local, rm, remote = _pair(initiator, target)
    remote[:] = rng.integers(0, 256, remote.size, dtype=np.uint8)
    local.array[:] = POISON
    offs = np.arange(0, 16 * 4096, 4096, dtype=np.int64)
    sess = initiator.create_session(local.desc, rm)
    with pytest.raises(TypeError, match="local_offsets.*contiguous"):
        sess.batch_read(offs[::2], offs[::2], np.full(8, 512), 1)
    st = sess.batch_read(np.ascontiguousarray(offs[::2]), offs[::2].copy(), np.full(8, 512), 1)
    assert st.WaitFor(20_000) == StatusCode.SUCCESS, st.Message()
    for o in offs[::2]:
        np.testing.assert_array_equal(local.array[o:o + 512], remote[o:o + 512])
    initiator.deregister_memory(local.desc)


@pytest.mark.parametrize("bad,match", [
    ([0, -1], r"remote_offsets\[1\] must be a non-negative int below 2\*\*64, got -1"),
    ([0, True], r"remote_offsets\[1\].*got True"),
    ([0, 1.5], r"remote_offsets\[1\].*got 1.5"),
    ([0, "8"], r"remote_offsets\[1\].*got '8'"),
    ([0, 2**64], r"remote_offsets\[1\].*below 2\*\*64"),
    (np.array([0, -3], dtype=np.int64), r"remote_offsets\[1\].*got -3"),
    (np.array([0.0, 1.0]), r"remote_offsets must hold integers, got an array of format 'd'"),
    (np.zeros((2, 1), dtype=np.int64), r"remote_offsets must be 1-D"),
    ("01", r"remote_offsets must be a list of ints or a 1-D integer array, got str"),
    (5, r"remote_offsets must be a list of ints or a 1-D integer array, got int"),
])
def test_bad_offsets_raise_before_anything_moves(initiator, target, bad, match):
    local, rm, remote = _pair(initiator, target)
    local.array[:] = 1
    remote[:] = POISON
    sess = initiator.create_session(local.desc, rm)
    with pytest.raises(TypeError, match=match):
        sess.batch_write([0, 64], bad, [8, 8], 1)
    with pytest.raises(TypeError, match=match.replace("remote_offsets", r"remote_offsets\[0\]", 1)):
        initiator.batch_write([local.desc], [[0, 64]], [rm], [bad], [[8, 8]], [1])
    assert (remote == POISON).all()
    initiator.deregister_memory(local.desc)


def test_engine_batch_checks_every_pair_before_submitting(initiator, target):
    """A bad entry in the second pair: the first pair must not have been sent either."""
    local, rm, remote = _pair(initiator, target)
    local.array[:] = 1
    remote[:] = POISON
    with pytest.raises(TypeError, match=r"sizes\[1\]\[0\]"):
        initiator.batch_write([local.desc, local.desc], [[0], [64]], [rm, rm], [[0], [64]], [[8], [-8]], [1, 2])
    with pytest.raises(TypeError, match=r"remote_dest_mem_descs\[1\] must be a MemoryDesc"):
        initiator.batch_write([local.desc, local.desc], [[0], [64]], [rm, "x"], [[0], [64]], [[8], [8]], [1, 2])
    with pytest.raises(TypeError, match=r"transfer_uids\[0\]"):
        initiator.batch_write([local.desc], [[0]], [rm], [[0]], [[8]], [-1])
    assert (remote == POISON).all()
    initiator.deregister_memory(local.desc)


def test_io_profile_stamps_are_ordered(initiator, target):
    """The submission timestamps the benchmark's breakdown relies on."""
    import time

    local, rm, _ = _pair(initiator, target)
    sess = initiator.create_session(local.desc, rm)
    _C.io_profile(True)
    try:
        t0 = time.perf_counter_ns()
        st = sess.batch_write(np.arange(0, 4096, 1024), np.arange(0, 4096, 1024), np.full(4, 100), 3)
        t1 = time.perf_counter_ns()
        p = _C.io_profile_last()
    finally:
        _C.io_profile(False)
    assert st.WaitFor(20_000) == StatusCode.SUCCESS
    assert t0 <= p["enter"] <= p["converted"] <= p["validated"] <= p["submitted"] <= t1, p
    assert p["path"] == "none"  # TCP: no GPU engine involved
    initiator.deregister_memory(local.desc)


@pytest.mark.parametrize("api", ["session", "engine"])
def test_out_of_range_segments_are_named_as_given(initiator, target, api):
    """Bounds are checked while contiguous segments merge (one pass): the failing segment keeps
    its index in the caller's list, an empty segment past the end fails too, and nothing moves."""
    size = 1 << 16
    local, rm, remote = _pair(initiator, target, size)
    local.array[:] = 1
    remote[:] = POISON
    cases = [
        # two segments that merge, then one past the remote end: segment 2
        (([0, 8, 16], [0, 8, size - 4], [8, 8, 8]), r"segment 2: remote range \[65532, 65532\+8\) exceeds the registered size 65536"),
        # an empty segment beyond the local end still fails
        (([0, size + 1], [0, 64], [8, 0]), r"segment 1: local range \[65537, 65537\+0\) exceeds"),
    ]
    for (lo, ro, sz), match in cases:
        if api == "session":
            st = initiator.create_session(local.desc, rm).batch_write(lo, ro, sz, 7)
        else:
            st = initiator.batch_write([local.desc], [lo], [rm], [ro], [sz], [7])[0]
        assert st.Code() == StatusCode.ERR_INVALID_ARGS
        assert re.search(match, st.Message()), st.Message()
    assert (remote == POISON).all()
    # and a valid batch of merging segments still moves exactly its bytes
    st = initiator.create_session(local.desc, rm).batch_write([0, 8, 100], [0, 8, 200], [8, 8, 4], 8)
    initiator.wait_all([st], 5000)
    assert st.Code() == StatusCode.SUCCESS
    assert (remote[:16] == 1).all() and (remote[200:204] == 1).all()
    assert (remote[16:200] == POISON).all() and (remote[204:] == POISON).all()
    initiator.deregister_memory(local.desc)


def test_engine_batch_outer_lists_are_checked_first(initiator, target):
    """Outer lists of different lengths, or one that is not a list: a clear error, nothing moves."""
    local, rm, remote = _pair(initiator, target)
    remote[:] = POISON
    with pytest.raises(ValueError, match="must have the same length"):
        initiator.batch_write([local.desc], [[0]], [rm, rm], [[0]], [[8]], [1])
    with pytest.raises(ValueError, match="must have the same length"):
        initiator.batch_write([local.desc], [[0]], [rm], [[0]], [[8]], [1, 2])
    with pytest.raises(TypeError, match=r"local_src_mem_descs must be a list \(one entry per memory pair\), got int"):
        initiator.batch_write(5, [[0]], [rm], [[0]], [[8]], [1])
    assert (remote == POISON).all()
    initiator.deregister_memory(local.desc)
