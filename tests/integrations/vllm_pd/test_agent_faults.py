"""Faults between the connector's workers: every wait is bounded, blocks are released on both sides.

Same harness as ``test_agent_transfers`` (real agents in their own processes, vLLM faked):
a decode that aborts, a prefill that dies or aborts, a decode that never comes, a peer
with another shared secret.
"""

from __future__ import annotations

import time
from typing import Dict, Iterator

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

from mori_integrations.vllm.kv_connector.metadata import FinishedSend, RecvJob, SendJob  # noqa: E402
from pd_cluster import Server, check_moved  # noqa: E402

FAST = {"transfer_timeout": 1, "recv_abort_timeout": 4, "defer_timeout": 2, "handshake_timeout": 2}


@pytest.fixture(scope="module")
def pair() -> Iterator[Dict[str, Server]]:
    made: Dict[str, Server] = {}
    try:
        made["P"] = Server("f-prefill", 1, extra=FAST)
        made["P"].ranks[0].call("fill", 3)
        made["D"] = Server("f-decode", 1, extra=FAST)
        yield made
    finally:
        for s in made.values():
            s.close()


def _job(src: Server, dst: Server, tid: str, mode: str, n: int = 2) -> tuple:
    sb, db = src.blocks(n), dst.blocks(n)
    job = RecvJob(req_id=f"d-{tid}", transfer_id=tid, mode=mode, peer=src.address, local_block_ids=[db],
                  positions=[0], num_prompt_tokens=n * 16, remote_block_ids=[sb] if mode == "read" else None,
                  remote_instance_id=src.instance if mode == "read" else None)
    return job, SendJob(req_id=f"p-{tid}", transfer_id=tid, block_ids=[sb], num_prompt_tokens=n * 16), sb, db


def test_decode_abort_while_waiting_for_writes_ends_at_once(pair) -> None:
    p, d = pair["P"].ranks[0], pair["D"].ranks[0]
    job, _, _, _ = _job(pair["P"], pair["D"], "abort-wait", "write")
    d.call("recv", job)
    deadline = time.monotonic() + 20
    while not p.call("pending")[0] and time.monotonic() < deadline:  # the prefill got the write request
        time.sleep(0.05)
    t0 = time.monotonic()
    d.call("abort", [job.req_id])
    (result,) = d.call("results", (1, 20), timeout=40)
    # Ended by the prefill's acknowledgement (it will not write), not by recv_abort_timeout.
    assert result.aborted and not result.ok, result
    assert time.monotonic() - t0 < FAST["recv_abort_timeout"], "abort waited for the timeout instead of the ack"


def test_prefill_abort_fails_a_waiting_decode_at_once(pair) -> None:
    p, d = pair["P"].ranks[0], pair["D"].ranks[0]
    job, send, _, _ = _job(pair["P"], pair["D"], "prefill-abort", "write")
    d.call("recv", job)
    deadline = time.monotonic() + 20
    while not p.call("pending")[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    p.call("finish", FinishedSend(req_id=send.req_id, transfer_id=job.transfer_id, aborted=True, blocks_held=False))
    (result,) = d.call("results", (1, 20), timeout=40)
    assert not result.ok and "aborted" in result.reason, result
    assert result.wait_ms < FAST["recv_abort_timeout"] * 1000


def test_unclaimed_prefill_blocks_are_released_after_defer_timeout(pair) -> None:
    p = pair["P"].ranks[0]
    _, send, _, _ = _job(pair["P"], pair["D"], "nobody", "read")
    p.call("send", (send, False))
    t0 = time.monotonic()
    p.call("finish", FinishedSend(req_id=send.req_id, transfer_id=send.transfer_id, aborted=False))
    assert p.call("take_finished", 20, timeout=40) == [send.req_id]
    assert FAST["defer_timeout"] - 0.5 <= time.monotonic() - t0 < FAST["defer_timeout"] + 10


def test_decode_whose_prefill_died_fails_within_the_bound_and_keeps_serving(pair) -> None:
    dead = Server("f-prefill-dies", 1, extra=FAST)
    d = pair["D"]
    try:
        dead.ranks[0].call("fill", 4)
        # A first transfer caches the handshake, then the prefill dies.
        job, send, sb, db = _job(dead, d, "before-death", "read")
        d.ranks[0].call("recv", job)
        assert d.results()[0].ok
        dead.ranks[0].kill()
        t0 = time.monotonic()
        job, _, _, _ = _job(dead, d, "after-death-read", "read")
        d.ranks[0].call("recv", job)
        (r,) = d.results()
        assert not r.ok and time.monotonic() - t0 < 15, r
        t0 = time.monotonic()
        job, _, _, _ = _job(dead, d, "after-death-write", "write")
        d.ranks[0].call("recv", job)
        (r,) = d.results()
        assert not r.ok, r
        assert time.monotonic() - t0 < FAST["recv_abort_timeout"] + FAST["handshake_timeout"] + 10, r
    finally:
        dead.close()
    # The decode still serves another prefill.
    job, send, sb, db = _job(pair["P"], d, "after-death-ok", "write")
    pair["P"].ranks[0].call("send", (send, False))
    d.ranks[0].call("recv", job)
    assert d.results()[0].ok
    check_moved(pair["P"], d, sb, db)


def test_control_plane_refuses_a_peer_with_another_secret() -> None:
    p = Server("a-prefill", 1, extra={**FAST, "auth_secret": "right"})
    good = Server("a-decode", 1, extra={**FAST, "auth_secret": "right"})
    bad = Server("a-intruder", 1, extra={**FAST, "auth_secret": "wrong"})
    try:
        p.ranks[0].call("fill", 5)
        job, send, sb, db = _job(p, good, "auth-ok", "write")
        p.ranks[0].call("send", (send, False))
        good.ranks[0].call("recv", job)
        assert good.results()[0].ok
        check_moved(p, good, sb, db)
        job, send, _, _ = _job(p, bad, "auth-bad", "read")
        bad.ranks[0].call("recv", job)
        (r,) = bad.results()
        assert not r.ok and "handshake" in r.reason, r
    finally:
        for s in (p, good, bad):
            s.close()


def test_a_second_request_with_a_live_transfer_id_is_refused_not_mixed_up(pair) -> None:
    d = pair["D"].ranks[0]
    first, _, _, _ = _job(pair["P"], pair["D"], "dup-id", "write")
    second, _, _, _ = _job(pair["P"], pair["D"], "dup-id", "write")
    second = RecvJob(**{**second.__dict__, "req_id": "d-dup-id-2"})
    d.call("recv", first)
    d.call("recv", second)
    (r,) = d.call("results", (1, 10), timeout=30)
    assert r.req_id == "d-dup-id-2" and not r.ok and "already in use" in r.reason, r
    d.call("abort", [first.req_id])
    (r,) = d.call("results", (1, 20), timeout=40)
    assert r.req_id == first.req_id and r.aborted, r
