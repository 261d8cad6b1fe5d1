"""A peer process that dies mid-request ends the request in KVPoll.Failed within the timeout."""

from __future__ import annotations

import time

import pytest

from pd_cluster import start_hosts
from scenario import FAILED, SUCCESS, bootstrap_request, deploy, layout, new_request, wait_status

WAITING_TIMEOUT_S = 6


@pytest.fixture
def hosts(tmp_path):
    # Px serves two decode hosts; the bootstrap server (B) outlives Px, as when one
    # prefill scheduler crashes while its HTTP server keeps answering.
    env = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S)}
    hs = start_hosts(["B", "Px", "Dx", "Dy"], tmp_path, env)
    yield hs
    for h in hs.values():
        h.close()


def test_decode_death_then_prefill_death(hosts) -> None:
    lay = layout(mla=False, page_size=16)
    # Phase 1: the decode process dies after sending its metadata -> prefill fails.
    dep = deploy({"B": hosts["B"], "P0": hosts["Px"], "D0": hosts["Dx"]}, lay, 1, 1)
    req = new_request(dep, seed=21)
    bootstrap_request(dep, req)
    hosts["Dx"].kill()
    start = time.monotonic()
    hosts["Px"].call("sender_send", name=dep.name, room=req.room, pages=req.src_pages, state=None)
    got = wait_status(hosts["Px"], "sender", dep, req, [FAILED, SUCCESS], timeout=40)
    assert got["status"] == FAILED, "a write into a dead decode process must fail"
    assert time.monotonic() - start < 40
    reason = hosts["Px"].call("failure", side="sender", name=dep.name, room=req.room)
    assert "KV transfer failed" in reason, reason

    # Phase 2: a second decode bootstraps with the same prefill, which then dies.
    dep.hosts = {"B": hosts["B"], "P0": hosts["Px"], "D0": hosts["Dy"]}
    hosts["Dy"].call(
        "manager", name=dep.name, role="decode", tp_size=1, tp_rank=0,
        bootstrap_port=int(dep.addr.rsplit(":", 1)[1]), layout=lay, seed=0,
    )
    req2 = new_request(dep, seed=22)
    bootstrap_request(dep, req2)
    hosts["Px"].kill()
    got = wait_status(hosts["Dy"], "receiver", dep, req2, [FAILED, SUCCESS], timeout=WAITING_TIMEOUT_S + 20)
    assert got["status"] == FAILED, "decode must give up on a dead prefill"
    assert got["elapsed"] < WAITING_TIMEOUT_S + 10, got
