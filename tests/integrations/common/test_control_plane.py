"""The shared control plane (issue #29 items 1, 2, 4): codec framing and recipient binding,
CURVE sockets with bounded frames, the total log budget.

Real msgspec messages and real ZMQ sockets on loopback; nothing of the framework adapters.
"""

from __future__ import annotations

import logging
from typing import Annotated

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from mori_integrations.common.control_codec import PIECE_BYTES, ControlCodec, ControlMessageError  # noqa: E402
from mori_integrations.common.log_limit import RateLimitedLog  # noqa: E402
from mori_integrations.common.net import canonical_tcp_address  # noqa: E402
from mori_integrations.common.zmq_setup import (  # noqa: E402
    close_listener,
    curve_available,
    curve_keys,
    secure_client,
    secure_listener,
)


class Note(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    text: Annotated[str, msgspec.Meta(max_length=1 << 20)]


KINDS = {b"NOTE": (Note, 1 << 20)}


def codec(secret: str = "") -> ControlCodec:
    return ControlCodec(b"TestGuard1", KINDS, secret.encode())


# ------------------------------------------------------------------ framing
def test_bodies_travel_in_small_frames_and_oversized_ones_are_refused() -> None:
    c = codec()
    big = Note(text="x" * (3 * PIECE_BYTES + 5))
    frames = c.encode(big)
    assert len(frames) == 2 + 4 and all(len(f) <= PIECE_BYTES for f in frames)
    assert all(len(f) <= c.max_frame_bytes for f in frames)
    assert c.decode(frames) == big
    with pytest.raises(ControlMessageError, match="pieces"):
        c.decode(frames[:2] + [b"\x00" * (PIECE_BYTES + 1)])  # one frame larger than a piece
    with pytest.raises(ControlMessageError, match="pieces"):
        c.decode(frames[:2] + [b"\x00"] * ((1 << 20) // PIECE_BYTES + 2))  # more pieces than the limit needs
    with pytest.raises(ControlMessageError, match="exceeds"):
        c.encode(Note(text="y" * ((1 << 20) + 1)))


# -------------------------------------------------------- recipient binding
def test_a_message_is_accepted_only_by_its_recipient() -> None:
    """Item 1: the tag binds the recipient; every other recipient refuses, whatever its seen-nonce set."""
    sender, s1, s2 = codec("s3cret"), codec("s3cret"), codec("s3cret")  # three processes, one secret
    frames = sender.encode(Note(text="pull"), recipient="tcp://10.0.0.1:5000")
    with pytest.raises(ControlMessageError, match="addressed to 'tcp://10.0.0.1:5000', not to 'tcp://10.0.0.2:5000'"):
        s2.decode(frames, recipient="tcp://10.0.0.2:5000")  # a fresh process: its nonce set is empty
    with pytest.raises(ControlMessageError, match="addressed to"):
        s2.decode(frames)  # a listener that expects unbound messages refuses bound ones too
    assert s1.decode(frames, recipient="tcp://10.0.0.1:5000") == Note(text="pull")
    with pytest.raises(ControlMessageError, match="replayed"):
        s1.decode(frames, recipient="tcp://10.0.0.1:5000")
    relabelled = frames[:-1] + [frames[-1][:56] + b"tcp://10.0.0.2:5000"]  # the recipient travels in clear
    with pytest.raises(ControlMessageError, match="bad authentication"):
        s2.decode(relabelled, recipient="tcp://10.0.0.2:5000")
    with pytest.raises(ControlMessageError, match="addressed to no one in particular"):
        s1.decode(sender.encode(Note(text="unbound")), recipient="tcp://10.0.0.1:5000")


def test_a_reply_is_accepted_only_as_the_answer_to_its_request() -> None:
    client, server = codec("s3cret"), codec("s3cret")
    req_a = client.encode(Note(text="a"), recipient="srv")
    req_b = client.encode(Note(text="b"), recipient="srv")
    server.decode(req_a, recipient="srv")
    reply_a = server.encode(Note(text="answer a"), recipient=server.reply_binding(req_a))
    with pytest.raises(ControlMessageError, match="not to the request"):
        client.decode(reply_a, recipient=client.reply_binding(req_b))
    assert client.decode(reply_a, recipient=client.reply_binding(req_a)) == Note(text="answer a")
    assert codec().reply_binding(req_a) == b"" and server.reply_binding([b"g", b"k", b"body"]) == b""


def test_secret_mismatches_are_named() -> None:
    signed, plain = codec("s3cret"), codec()
    with pytest.raises(ControlMessageError, match="this side has no shared secret"):
        plain.decode(signed.encode(Note(text="x")))
    with pytest.raises(ControlMessageError, match="unauthenticated"):
        signed.decode(plain.encode(Note(text="x")))
    with pytest.raises(ControlMessageError, match="bad authentication"):
        codec("other").decode(signed.encode(Note(text="x")))


def test_canonical_address_resolves_names_and_keeps_literals() -> None:
    assert canonical_tcp_address("tcp://localhost:5000") == "tcp://127.0.0.1:5000"
    assert canonical_tcp_address("tcp://10.1.2.3:7") == "tcp://10.1.2.3:7"
    assert canonical_tcp_address("tcp://[::1]:7") == "tcp://[::1]:7"


# --------------------------------------------------------- CURVE listeners
def _drain(sock: zmq.Socket, wait_ms: int) -> list:
    got = []
    while sock.poll(wait_ms):
        got.append(sock.recv_multipart())
        wait_ms = 200
    return got


@pytest.mark.skipif(not curve_available(), reason="this libzmq has no CURVE")
def test_only_holders_of_the_secret_get_past_the_connection() -> None:
    """Item 2: with a secret, a client without it (or with another one) delivers nothing; a
    frame above the bound drops even an authenticated connection; the ZAP handler stops
    with the last listener, so the context terminates."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    authenticated = secure_listener(pull, b"s3cret", 4096)
    assert authenticated
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    clients = []

    def client(secret: bytes, payload: bytes) -> None:
        c = ctx.socket(zmq.PUSH)
        c.setsockopt(zmq.LINGER, 0)
        secure_client(c, secret, 4096)
        c.connect(f"tcp://127.0.0.1:{port}")
        clients.append(c)
        try:
            c.send(payload, zmq.NOBLOCK)
        except zmq.Again:  # no connection came up: nothing to queue on
            pass

    try:
        client(b"", b"no secret")
        client(b"another secret", b"another secret")
        client(b"s3cret", b"x" * 5000)  # authenticated, but above the frame bound
        assert _drain(pull, 1500) == []
        client(b"s3cret", b"legit")
        assert _drain(pull, 5000) == [[b"legit"]]
    finally:
        for c in clients:
            c.close(0)
        close_listener(pull, authenticated)
    ctx.term()  # returns only when the ZAP handler's sockets are closed


def test_keys_are_derived_from_the_secret() -> None:
    a, b = curve_keys(b"s3cret"), curve_keys(b"other")
    assert a == curve_keys(b"s3cret") and a.server_public != b.server_public and a.zap_domain != b.zap_domain
    assert len(a.server_public) == len(a.client_secret) == 40  # Z85 of 32 bytes
    with pytest.raises(ValueError, match="empty"):
        curve_keys(b"")


# ---------------------------------------------------------------- log budget
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_logs_are_bounded_over_all_sources_with_a_summary(caplog) -> None:
    """Item 4: 3,000 sources, 3 events each, within one window: 5 lines, then one summary
    that counts the 8,995 others; a quiet window writes nothing."""
    clock = _Clock()
    log = RateLimitedLog(logging.getLogger("test.budget"), interval_s=10.0, max_lines=5, what="bad frames",
                         clock=clock)
    caplog.set_level(logging.WARNING, logger="test.budget")
    for i in range(3000):
        for _ in range(3):
            log.warning(f"10.0.{i // 250}.{i % 250}", "bad frame from %s", i)
        clock.now += 0.001
    assert len(caplog.records) == 5
    log.tick()  # within the window: nothing yet
    assert len(caplog.records) == 5
    clock.now += 10.0
    log.tick()
    assert len(caplog.records) == 6
    summary = caplog.records[-1].getMessage()
    assert "8995 more bad frames from 3000 source(s) were not logged in the last 10 s" in summary
    clock.now += 10.0
    log.tick()
    assert len(caplog.records) == 6 and log.events == 9000 and log.lines == 6
    log.warning("10.0.0.0", "bad frame from %s", 0)  # a new window: the source may log again
    assert len(caplog.records) == 7


def test_one_source_gets_one_line_per_interval(caplog) -> None:
    clock = _Clock()
    log = RateLimitedLog(logging.getLogger("test.source"), interval_s=10.0, clock=clock)
    caplog.set_level(logging.WARNING, logger="test.source")
    assert log.warning("a", "x") and not log.warning("a", "x") and log.warning("b", "y")
    clock.now += 10.0
    assert log.warning("a", "x")
    assert [r.getMessage() for r in caplog.records] == [
        "x", "y", "1 more similar events from 1 source(s) were not logged in the last 10 s (at most one line "
        "per source and 5 in total per 10 s; busiest source a: 1)", "x"]
