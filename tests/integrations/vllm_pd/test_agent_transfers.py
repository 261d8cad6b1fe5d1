"""The connector's worker side moving vLLM-layout KV between processes (CPU, TCP backend).

Each "worker" is a real ``TransferAgent`` (IO engine, control plane, producer/consumer
state machines) in its own process, with KV views laid out like vLLM's; only vLLM is
faked (see :mod:`pd_cluster`). Bytes are compared head by head.
"""

from __future__ import annotations

import os
from typing import Dict, Iterator

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pd_cluster import Server, Shape, check_moved, transfer  # noqa: E402
from mori_integrations.vllm.kv_connector.tp_mapping import heads_of_rank  # noqa: E402


@pytest.fixture(scope="module")
def servers() -> Iterator[Dict[str, Server]]:
    made: Dict[str, Server] = {}
    try:
        made["P"] = Server("prefill-tp1", 1)
        made["P"].ranks[0].call("fill", 1)
        made["P2"] = Server("prefill-tp2", 2)
        for i, r in enumerate(made["P2"].ranks):
            r.call("fill", 10 + i)
        made["D"] = Server("decode-tp1", 1, layout="LBNHC")  # another layout than the prefills'
        made["D2"] = Server("decode-tp2", 2)
        yield made
    finally:
        for s in made.values():
            s.close()


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("pair", ["P>D", "P2>D", "P>D2"])
def test_kv_moves_between_tp_sizes_and_layouts(servers, mode: str, pair: str) -> None:
    src, dst = (servers[k] for k in pair.split(">"))
    before = [r.call("totals")["bytes_received"] for r in dst.ranks]
    results, released, sb, db, req = transfer(src, dst, mode, n=5, skip=1, pipelined_race=(mode == "write"))
    assert all(r.ok for r in results), results
    assert released == [[req]] * src.tp, "the prefill must release the request once every decode rank is done"
    check_moved(src, dst, sb[1:], db[1:])
    assert dst.zero(db[:1]), "the decode's own prefix-cache block was overwritten"
    moved = [r.call("totals")["bytes_received"] - b for r, b in zip(dst.ranks, before)]
    heads_per_rank = len(heads_of_rank(src.shape.total_heads, dst.tp, 0))
    assert moved == [4 * heads_per_rank * src.shape.head_block_bytes] * dst.tp
    assert sum(r.nbytes for r in results) == sum(moved)


def test_write_request_after_the_kv_was_computed(servers) -> None:
    results, released, sb, db, req = transfer(servers["P"], servers["D"], "write", n=3, skip=0)
    assert all(r.ok for r in results), results
    check_moved(servers["P"], servers["D"], sb, db)
    assert released == [[req]]


def test_transfers_submitted_without_a_thread_hand_off() -> None:
    """Over XGMI (where submitting only queues copies) a write request that finds its KV computed
    is written by the prefill's control thread, and a READ is submitted by the decode's model
    thread (no hand-off to the writer / a transfer thread). Forced here over TCP: the bytes must
    still arrive, head by head, between TP sizes, and the early (layer-pipelined) WRITE must
    still go through the writer thread."""
    made: Dict[str, Server] = {}
    try:
        made["P"] = Server("prefill-inline", 1, submit_inline=True)
        made["P"].ranks[0].call("fill", 3)
        made["D2"] = Server("decode-inline", 2, submit_inline=True)
        p, d = made["P"], made["D2"]
        for mode, race in (("write", False), ("read", False), ("write", True)):
            before = [r.call("submit_threads") for r in p.ranks + d.ranks]
            results, released, sb, db, req = transfer(p, d, mode, n=4, skip=1, pipelined_race=race)
            assert all(r.ok for r in results), (mode, race, results)
            assert released == [[req]], (mode, race, released)
            check_moved(p, d, sb[1:], db[1:])
            assert d.zero(db[:1])
            threads = [r.call("submit_threads")[len(b):] for r, b in zip(p.ranks + d.ranks, before)]
            prefill, decode = threads[0], threads[1:]
            if mode == "read":
                assert prefill == [] and all(t == ["MainThread"] for t in decode), threads
            elif race:
                # The first decode rank's request came before the forward: layer by layer through the
                # writer. The second rank's may come before or after it (then: written on arrival).
                assert "mori-kv-writer" in prefill and set(prefill) <= {"mori-kv-writer", "mori-kv-ctl-tp0"}, threads
            else:  # each decode rank's request, written on arrival by the control thread
                assert prefill == ["mori-kv-ctl-tp0"] * 2, threads
    finally:
        for s in made.values():
            s.close()


def test_lead_layers_are_submitted_in_a_call_of_their_own() -> None:
    """With ``lead_layers``, a transfer over many layers is planned and submitted in two parts (the
    lead layers, then the rest), so the lead's copy runs while the rest is prepared. Whoever
    submits (the prefill in WRITE, each decode rank in READ, between TP sizes) stamps two
    submissions; with ``lead_layers`` 0 one. The bytes are checked head by head every time."""
    shape = Shape(layers=8)
    made: Dict[str, Server] = {}
    try:
        made["P"] = Server("prefill-lead", 1, shape=shape, extra={"lead_layers": 3})
        made["P"].ranks[0].call("fill", 5)
        made["D2"] = Server("decode-lead", 2, shape=shape, extra={"lead_layers": 5})
        made["P0"] = Server("prefill-nolead", 1, shape=shape, extra={"lead_layers": 0})
        made["P0"].ranks[0].call("fill", 6)
        made["D0"] = Server("decode-nolead", 1, shape=shape, extra={"lead_layers": 0})
        for src, dst, split in (("P", "D2", True), ("P0", "D0", False)):
            p, d = made[src], made[dst]
            for r in p.ranks + d.ranks:
                r.call("trace", ("on", None))
            for mode in ("write", "read"):
                results, released, sb, db, req = transfer(p, d, mode, n=6, skip=1)
                assert all(r.ok for r in results), (src, mode, results)
                assert released == [[req]], (src, mode, released)
                check_moved(p, d, sb[1:], db[1:])
                assert d.zero(db[:1])
                tid = req[len("p-"):]
                submitters = p.ranks if mode == "write" else d.ranks
                for r in submitters:
                    first, last = r.call("trace", ("take", tid))["submitted"]
                    assert (first < last) == split, (src, mode, first, last)
    finally:
        for s in made.values():
            s.close()


def _phases(server: Server, tid: str) -> list:
    return [sorted(r.call("trace", ("take", tid))) for r in server.ranks]


def test_same_host_write_requests_and_doorbells() -> None:
    """A decode sends its write requests to the prefill's same-host inbox, and a prefill on the
    decode's host rings the decode's doorbell (shared memory) when its writes completed. A decode that drops every WriteDone message (``drop_write_done``) still finishes
    its WRITEs, from the doorbells alone. Without a board (switched off, or one the prefill
    cannot open, as from another host) nothing rings and the WriteDone messages finish the
    request. The bytes are checked head by head every time."""
    made: Dict[str, Server] = {}
    try:
        made["P2"] = Server("prefill-bell", 2, extra={"control_spin_ms": 300})  # its control threads spin too
        for i, r in enumerate(made["P2"].ranks):
            r.call("fill", 20 + i)
        made["D2"] = Server("decode-bell", 2, drop_write_done=True)
        made["Doff"] = Server("decode-nobell", 1, extra={"same_host_signals": False})
        made["Dgone"] = Server("decode-gone", 1)
        p = made["P2"]
        board = made["Dgone"].ranks[0].call("info")["doorbell"]
        assert board.startswith("mori-bell-"), board
        os.unlink(os.path.join("/dev/shm", board))  # the prefill cannot open it now
        assert made["Doff"].ranks[0].call("info")["doorbell"] == ""
        for name, rung in (("D2", True), ("Doff", False), ("Dgone", False)):
            d = made[name]
            for r in p.ranks + d.ranks:
                r.call("trace", ("on", None))
            for race in (False, True):
                inbox_before = [r.call("inbox_messages") for r in p.ranks]
                results, released, sb, db, req = transfer(p, d, "write", n=4, skip=1, pipelined_race=race)
                # Write requests came through the prefill ranks' inboxes unless the decode opted out.
                inbox = [r.call("inbox_messages") - b for r, b in zip(p.ranks, inbox_before)]
                assert inbox == [0 if name == "Doff" else d.tp] * p.tp, (name, race, inbox)
                assert all(r.ok for r in results), (name, race, results)
                assert released == [[req]] * p.tp, (name, race, released)
                check_moved(p, d, sb[1:], db[1:])
                assert d.zero(db[:1])
                tid = req[len("p-"):]
                decode, prefill = _phases(d, tid), _phases(p, tid)
                assert all(("doorbell_seen" in ph) == rung for ph in decode), (name, race, decode)
                assert all(("doorbell_rung" in ph) == rung for ph in prefill), (name, race, prefill)
                if rung:  # each decode rank finished only from the bells of both prefill ranks
                    assert all(r.nbytes > 0 for r in results), results
    finally:
        for s in made.values():
            s.close()
