"""The post planner: sort, merge, split into chains over QPs with selective
signalling and send-queue limits (pure logic, no NIC)."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

KiB = 1024
MiB = 1024 * KiB


def plan(t: ModuleType, segments: list[tuple[int, int, int]], **kw: object) -> dict:
    return t.plan_posts(segments, **kw)


def wr_pieces(p: dict, i: int) -> list[tuple[int, int]]:
    _, _, first, n = p["wrs"][i]
    return p["sges"][first : first + n]


def normalized(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(remote, local, length) pieces sorted by remote, neighbours contiguous on both sides joined."""
    out: list[list[int]] = []
    for r, l, n in sorted(x for x in pieces if x[2] > 0):
        if out and out[-1][0] + out[-1][2] == r and out[-1][1] + out[-1][2] == l:
            out[-1][2] += n
        else:
            assert not out or out[-1][0] + out[-1][2] <= r, "a remote byte is moved twice"
            out.append([r, l, n])
    return [tuple(x) for x in out]


def byte_map(p: dict) -> list[tuple[int, int, int]]:
    """What the plan moves, as normalized (remote, local, length) pieces."""
    pieces = []
    for i, (remote, length, _, _) in enumerate(p["wrs"]):
        r = remote
        for lo, ln in wr_pieces(p, i):
            pieces.append((r, lo, ln))
            r += ln
        assert r - remote == length, "WR length differs from the sum of its SGEs"
    return normalized(pieces)


def expected_map(segs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    return normalized([(ro, lo, n) for lo, ro, n in segs])


def check_invariants(p: dict, *, num_qps: int, uid: int, max_sge: int, sq_depth: int, notify: bool) -> None:
    wrs = p["wrs"]
    limit = p["wr_byte_limit"]
    for i, (remote, length, _, n) in enumerate(wrs):
        assert 1 <= n <= max_sge
        assert 0 < length <= limit
        if i:
            prev_remote, prev_len, _, prev_n = wrs[i - 1]
            assert prev_remote + prev_len <= remote, "WRs out of remote order or overlapping"
            if prev_remote + prev_len == remote and prev_len < limit:
                # Mergeable neighbours must have been merged unless the SGE list was full.
                prev_last = wr_pieces(p, i - 1)[-1]
                first = wr_pieces(p, i)[0]
                local_contig = prev_last[0] + prev_last[1] == first[0]
                assert prev_n == max_sge and not local_contig, f"WR {i} should have been merged"
    # Chains: contiguous, in order, bounded, round robin from uid % num_qps.
    cap = sq_depth - (1 if notify else 0)
    nxt = 0
    for ci, (qp, first, n) in enumerate(p["chains"]):
        assert first == nxt and 1 <= n <= min(cap, p["batch_size"])
        assert qp == (ci + uid) % num_qps
        nxt += n
    assert nxt == len(wrs)
    assert p["qps_used"] == sorted({c[0] for c in p["chains"]})


def test_contiguous_pages_become_one_wr(rdma_testing: ModuleType) -> None:
    segs = [(i * 4 * KiB, 1 * MiB + i * 4 * KiB, 4 * KiB) for i in range(64)]
    random.Random(1).shuffle(segs)  # order of the request must not matter
    p = plan(rdma_testing, segs)
    assert p["wrs"] == [(1 * MiB, 256 * KiB, 0, 1)]
    assert p["sges"] == [(0, 256 * KiB)]
    assert p["chains"] == [(0, 0, 1)]


def test_remote_contiguous_local_scattered_uses_sge_lists(rdma_testing: ModuleType) -> None:
    # Remote pages back to back, local pages 2 pages apart: gather lists of up to max_sge.
    segs = [(i * 8 * KiB, i * 4 * KiB, 4 * KiB) for i in range(10)]
    p = plan(rdma_testing, segs, max_sge=4)
    assert [w[1] for w in p["wrs"]] == [16 * KiB, 16 * KiB, 8 * KiB]
    assert [w[3] for w in p["wrs"]] == [4, 4, 2]
    assert wr_pieces(p, 1) == [(32 * KiB, 4 * KiB), (40 * KiB, 4 * KiB), (48 * KiB, 4 * KiB), (56 * KiB, 4 * KiB)]
    assert byte_map(p) == expected_map(segs)


def test_remote_gaps_are_never_merged(rdma_testing: ModuleType) -> None:
    p = plan(rdma_testing, [(0, 0, 100), (100, 200, 100)])
    assert [(w[0], w[1]) for w in p["wrs"]] == [(0, 100), (200, 100)]


def test_zero_sizes_and_empty_input(rdma_testing: ModuleType) -> None:
    assert plan(rdma_testing, [])["chains"] == []
    p = plan(rdma_testing, [(0, 0, 0), (8, 8, 0)])
    assert p["wrs"] == [] and p["chains"] == [] and p["qps_used"] == []


def test_max_message_size_splits(rdma_testing: ModuleType) -> None:
    p = plan(rdma_testing, [(0, 0, 10 * KiB)], max_msg_bytes=4 * KiB)
    assert [(w[0], w[1]) for w in p["wrs"]] == [(0, 4 * KiB), (4 * KiB, 4 * KiB), (8 * KiB, 2 * KiB)]


def test_wr_never_reaches_4gib(rdma_testing: ModuleType) -> None:
    # SGE lengths are 32-bit: even a NIC that claims a huge max_msg_sz gets <= 2 GiB WRs.
    p = plan(rdma_testing, [(0, 0, 5 << 30)], max_msg_bytes=1 << 40)
    assert p["wr_byte_limit"] == 1 << 31
    assert [w[1] for w in p["wrs"]] == [1 << 31, 1 << 31, 1 << 30]


def test_chunking_spreads_one_transfer_over_qps(rdma_testing: ModuleType) -> None:
    p = plan(rdma_testing, [(0, 0, 1 * MiB)], num_qps=4, chunking=True, chunk_bytes=64 * KiB, max_chunks=64)
    assert len(p["wrs"]) == 16 and all(w[1] == 64 * KiB for w in p["wrs"])
    assert [c[2] for c in p["chains"]] == [4, 4, 4, 4]  # automatic batch: one chain per QP
    assert p["qps_used"] == [0, 1, 2, 3]
    # max_chunks caps the number of pieces: the chunk grows to total / max_chunks.
    p = plan(rdma_testing, [(0, 0, 1 * MiB)], num_qps=4, chunking=True, chunk_bytes=64 * KiB, max_chunks=4)
    assert [w[1] for w in p["wrs"]] == [256 * KiB] * 4
    # Without chunking the transfer is a single WR on one QP.
    assert len(plan(rdma_testing, [(0, 0, 1 * MiB)], num_qps=4)["wrs"]) == 1


def test_explicit_batch_and_send_queue_limit(rdma_testing: ModuleType) -> None:
    segs = [(i * 2 * KiB, i * 2 * KiB, KiB) for i in range(100)]  # 100 separate WRs
    p = plan(rdma_testing, segs, num_qps=3, post_batch_size=30, sq_depth=16, notify=True)
    assert p["batch_size"] == 15  # one slot of the 16 stays free for the notification
    assert [c[2] for c in p["chains"]] == [15] * 6 + [10]
    check_invariants(p, num_qps=3, uid=0, max_sge=4, sq_depth=16, notify=True)
    p = plan(rdma_testing, segs, num_qps=3, post_batch_size=30, sq_depth=16, notify=False)
    assert p["batch_size"] == 16


def test_auto_batch_is_one_chain_per_qp(rdma_testing: ModuleType) -> None:
    segs = [(i * 2 * KiB, i * 2 * KiB, KiB) for i in range(10)]
    p = plan(rdma_testing, segs, num_qps=4)
    assert p["batch_size"] == 3 and [c[2] for c in p["chains"]] == [3, 3, 3, 1]


def test_uid_rotates_the_first_qp(rdma_testing: ModuleType) -> None:
    p = plan(rdma_testing, [(0, 0, 64)], num_qps=4, uid=5)
    assert p["chains"] == [(1, 0, 1)] and p["qps_used"] == [1]
    p = plan(rdma_testing, [(0, 0, KiB), (2 * KiB, 2 * KiB, KiB)], num_qps=4, uid=7, post_batch_size=1)
    assert [c[0] for c in p["chains"]] == [3, 0] and p["qps_used"] == [0, 3]


@pytest.mark.parametrize(
    "kw, fragment",
    [({"num_qps": 0}, "numQps"), ({"post_batch_size": 0}, "post_batch_size"), ({"post_batch_size": -2}, "post_batch_size"),
     ({"sq_depth": 1}, "too small"), ({"max_sge": 0}, "maxSge")],
)
def test_invalid_limits(rdma_testing: ModuleType, kw: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        plan(rdma_testing, [(0, 0, 8)], **kw)


@pytest.mark.parametrize("seed", range(200))
def test_random_requests_keep_every_byte_in_place(rdma_testing: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    # Non-overlapping remote ranges, partly adjacent; local offsets partly adjacent, partly scattered.
    segs = []
    remote = local = 0
    for _ in range(rng.randint(1, 60)):
        n = rng.choice([1, 7, 512, 4096, 8192, 65536])
        remote += rng.choice([0, 0, 0, 64, 4096])
        local = local if rng.random() < 0.6 else local + rng.choice([8, 4096, 1 << 20])
        segs.append((local, remote, n))
        remote += n
        local += n
    rng.shuffle(segs)
    kw = dict(
        uid=rng.randint(0, 1000),
        num_qps=rng.randint(1, 5),
        post_batch_size=rng.choice([-1, 1, 3, 64]),
        sq_depth=rng.choice([2, 5, 64]),
        max_sge=rng.choice([1, 2, 4]),
        max_msg_bytes=rng.choice([4096, 65536, 1 << 31]),
        chunking=rng.random() < 0.5,
        chunk_bytes=rng.choice([4096, 16384]),
        max_chunks=rng.choice([1, 8, 64]),
        notify=rng.random() < 0.7,
    )
    p = plan(rdma_testing, segs, **kw)
    assert byte_map(p) == expected_map(segs)
    check_invariants(p, num_qps=kw["num_qps"], uid=kw["uid"], max_sge=kw["max_sge"], sq_depth=kw["sq_depth"],
                     notify=kw["notify"])
