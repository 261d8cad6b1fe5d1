"""A prefill that dies, or restarts on the same ports, below vLLM (real agents and engines, vLLM faked).

The decode here trusts a cached handshake for an hour (``handshake_ttl``), so each way the
cache follows the producer process rather than its address is exercised on its own: a READ
naming the new ``remote_engine_id``; a WRITE sent with a stale handshake (the restarted
prefill refuses a request meant for its predecessor; the next request handshakes again); with
a fixed engine id (kept across the restart), a READ or WRITE carrying the dead process's
``remote_instance_id`` is refused at once and loads nothing, whether the decode still holds the
dead process's handshake or already one of the new process (issue #29 item 7: main read the
new process's blocks at the old ids); a WRITE in flight when the prefill dies ends within
seconds, not at ``recv_abort_timeout`` (60 s here). The vLLM-level version is in
``test_vllm_pd_e2e.py``.
"""

from __future__ import annotations

import time
from typing import Iterator, List, Optional, Tuple

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

from mori_integrations.vllm.kv_connector.metadata import RecvJob, SendJob  # noqa: E402
from pd_cluster import Server, check_moved  # noqa: E402

SLOW_ABORT = {"transfer_timeout": 2, "recv_abort_timeout": 60, "defer_timeout": 30, "handshake_timeout": 5,
              "handshake_ttl": 3600}
BOUND_S = 10.0  # the bound for a request to a dead prefill; recv_abort_timeout is 60 s


class Prefill:
    """The prefill server of these tests; :meth:`restart` kills it and starts another on its ports."""

    def __init__(self) -> None:
        self.server = self._start("x-prefill-0", None)

    @staticmethod
    def _start(name: str, ports: Optional[Tuple[int, int]]) -> Server:
        server = Server(name, 1, extra=SLOW_ABORT, ports=ports)
        server.ranks[0].call("fill", sum(map(ord, name)))  # each process holds other KV
        return server

    def kill(self) -> None:
        self.server.ranks[0].kill()

    def restart(self, name: str) -> Server:
        ports = self.server.base
        self.kill()
        self.server.close()
        self.server = self._start(name, ports)
        return self.server


@pytest.fixture(scope="module")
def servers() -> Iterator[Tuple[Prefill, Server]]:
    prefill: Optional[Prefill] = None
    decode: Optional[Server] = None
    try:
        prefill = Prefill()
        decode = Server("x-decode", 1, extra=SLOW_ABORT)
        yield prefill, decode
    finally:
        for s in (prefill.server if prefill else None, decode):
            if s is not None:
                s.close()


_ids = iter(range(1 << 30))


def _request(src: Server, dst: Server, mode: str, engine_id: Optional[str] = None, computed: bool = True,
             instance: Optional[str] = None, src_blocks: Optional[List[int]] = None
             ) -> Tuple[object, float, List[int], List[int]]:
    """One request of two blocks; returns (decode result, seconds until it, src blocks, dst blocks).

    ``computed``: the prefill has the request's KV (else it waits for a prefill that never comes).
    ``instance``: ``remote_instance_id`` (READ default: ``src``'s, as the prefill's response carries it).
    ``src_blocks``: the prefill's block ids named in the request (default: fresh ones).
    """
    tid = f"x{next(_ids)}-{mode}"
    sb, db = src_blocks or src.blocks(2), dst.blocks(2)
    if instance is None and mode == "read":
        instance = src.instance
    job = RecvJob(req_id=f"d-{tid}", transfer_id=tid, mode=mode, peer=src.address, local_block_ids=[db],
                  positions=[0], num_prompt_tokens=29, remote_block_ids=[sb] if mode == "read" else None,
                  remote_engine_id=engine_id, remote_instance_id=instance)
    if computed and src.ranks[0].proc.is_alive():
        src.ranks[0].call("send", (SendJob(req_id=f"p-{tid}", transfer_id=tid, block_ids=[sb], num_prompt_tokens=29),
                                   False))
    t0 = time.monotonic()
    dst.ranks[0].call("recv", job)
    (result,) = dst.results()
    return result, time.monotonic() - t0, sb, db


def test_read_after_a_restart_follows_the_new_remote_engine_id(servers) -> None:
    prefill, decode = servers
    r, _, _, _ = _request(prefill.server, decode, "read", "x-prefill-0")
    assert r.ok, r  # the decode caches prefill 0's handshake
    new = prefill.restart("x-prefill-1")
    r, took, sb, db = _request(new, decode, "read", "x-prefill-1")
    assert r.ok, r
    check_moved(new, decode, sb, db)
    # KV that lived on the dead process: refused at once, nothing read from the new one.
    r, took, _, _ = _request(new, decode, "read", "x-prefill-0")
    assert not r.ok and "x-prefill-0" in r.reason and "restarted" in r.reason, r
    assert took < BOUND_S, took


def test_write_with_a_stale_handshake_is_refused_at_once_and_the_next_one_handshakes_again(servers) -> None:
    prefill, decode = servers
    r, _, _, _ = _request(prefill.server, decode, "write")
    assert r.ok, r
    new = prefill.restart("x-prefill-2")
    r, took, _, _ = _request(new, decode, "write")
    assert not r.ok and "restarted" in r.reason, r
    assert took < BOUND_S, took
    print(f"\nWRITE with a stale handshake to a restarted prefill: failed after {took:.2f} s: {r.reason}")
    r, _, sb, db = _request(new, decode, "write")
    assert r.ok, r
    check_moved(new, decode, sb, db)


def test_a_fixed_engine_id_stale_read_is_refused_at_once_and_loads_nothing(servers) -> None:
    prefill, decode = servers
    old = prefill.restart("x-prefill-fixed")
    r, _, old_blocks, _ = _request(old, decode, "read", "x-prefill-fixed")
    assert r.ok, r  # the decode caches the first process's handshake
    dead = old.instance
    new = prefill.restart("x-prefill-fixed")  # a fixed engine_id: only the instance tells the processes apart
    assert new.instance != dead
    # 1) The decode still holds the dead process's handshake: the IO engine refuses the other process.
    r, took, _, db = _request(new, decode, "read", "x-prefill-fixed", computed=False, instance=dead,
                              src_blocks=old_blocks)
    assert not r.ok and took < BOUND_S, (r, took)
    assert decode.zero(db), "the decode loaded KV for a request of a dead prefill"
    # 2) The decode holds the new process's handshake (it served a request of its own) ...
    r, _, sb, db = _request(new, decode, "read", "x-prefill-fixed")
    assert r.ok, r
    check_moved(new, decode, sb, db)
    # ... then the dead process's params come again: refused by the instance, nothing read from the new one.
    r, took, _, db = _request(new, decode, "read", "x-prefill-fixed", computed=False, instance=dead,
                              src_blocks=old_blocks)
    assert not r.ok and dead in r.reason and "restarted" in r.reason, r
    assert took < BOUND_S, took
    assert decode.zero(db), "the decode loaded the new prefill's blocks for the dead prefill's request"
    print(f"\nstale READ (fixed engine id) after a restart: refused after {took:.2f} s: {r.reason}")


def test_a_fixed_engine_id_stale_write_is_refused_at_once(servers) -> None:
    prefill, decode = servers
    r, _, _, _ = _request(prefill.server, decode, "read", "x-prefill-fixed")
    assert r.ok, r  # the decode holds this process's handshake
    dead = prefill.server.instance
    new = prefill.restart("x-prefill-fixed")
    for attempt in ("stale handshake cached", "new handshake cached"):
        r, took, _, db = _request(new, decode, "write", "x-prefill-fixed", computed=False, instance=dead)
        assert not r.ok and "restarted" in r.reason, (attempt, r)
        assert took < BOUND_S, (attempt, took)
        assert decode.zero(db), attempt
        assert not new.ranks[0].call("pending")[0], f"{attempt}: the new prefill holds a write request for it"
        print(f"\nstale WRITE (fixed engine id, {attempt}) after a restart: refused after {took:.2f} s: {r.reason}")
    r, _, sb, db = _request(new, decode, "write", "x-prefill-fixed", instance=new.instance)
    assert r.ok, r
    check_moved(new, decode, sb, db)


def test_a_write_in_flight_when_the_prefill_dies_ends_within_seconds(servers) -> None:
    prefill, decode = servers
    live = prefill.restart("x-prefill-3")
    r, _, _, _ = _request(live, decode, "read", "x-prefill-3")
    assert r.ok, r  # the decode handshook with this process
    tid = f"x{next(_ids)}-inflight"  # the prefill gets the write request; its prompt never finishes computing
    job = RecvJob(req_id=f"d-{tid}", transfer_id=tid, mode="write", peer=live.address,
                  local_block_ids=[decode.blocks(2)], positions=[0], num_prompt_tokens=29)
    decode.ranks[0].call("recv", job)
    deadline = time.monotonic() + 20
    while not live.ranks[0].call("pending")[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    prefill.kill()
    t0 = time.monotonic()
    (r,) = decode.results()
    took = time.monotonic() - t0
    assert not r.ok and "gone" in r.reason, r
    assert took < BOUND_S, took
    print(f"\nWRITE in flight when the prefill died: failed {took:.2f} s after the kill: {r.reason}")


def test_new_requests_to_a_dead_prefill_end_within_seconds(servers) -> None:
    prefill, decode = servers
    live = prefill.restart("x-prefill-4")
    r, _, _, _ = _request(live, decode, "read", "x-prefill-4")
    assert r.ok, r  # a fresh handshake is cached ...
    prefill.kill()  # ... and goes stale
    for mode in ("write", "read"):
        r, took, _, _ = _request(live, decode, mode, "x-prefill-4" if mode == "read" else None)
        assert not r.ok, r
        assert took < BOUND_S, (mode, took)
        print(f"\n{mode.upper()} to a dead prefill: failed after {took:.2f} s: {r.reason}")
