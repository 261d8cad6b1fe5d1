"""The PD connector's side channel under hostile input (issue #21 items 6 and 9).

A real ControlServer on real ZMQ sockets; forged, garbled and invalid-UTF-8
frames are sent the way an outsider would.
"""

from __future__ import annotations

import logging
import random
import time

import pytest

pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from mori_integrations.common.net import detect_local_ip  # noqa: E402
from mori_integrations.common.zmq_setup import secure_client  # noqa: E402
from mori_integrations.vllm.kv_connector.control import ControlServer, fetch_metadata, notify_recipient  # noqa: E402
from mori_integrations.vllm.kv_connector.messages import (  # noqa: E402
    GUARD,
    AgentMetadata,
    ConsumerDone,
    LayerLayout,
    make_codec,
)


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _metadata() -> AgentMetadata:
    layer = LayerLayout(name="l", group=0, region=0, offset=0, block_stride=64, head_stride=32, num_heads=2,
                        head_runs=[(0, 32)], block_runs=[(0, 64)], content="float32:4x2")
    return AgentMetadata(engine_id="e", engine_desc=b"d", regions=[b"r"], layers=[layer], tp_rank=0, tp_size=1,
                         dp_rank=0, total_kv_heads=2, replicated_heads=False, block_size=16, group_block_sizes=[16],
                         notify_host="127.0.0.1", notify_port=1)


def _done(i: int) -> ConsumerDone:
    return ConsumerDone(transfer_id=f"t{i}", consumer_key="k", consumer_rank=0, consumer_tp=1, ok=True, nbytes=i)


def _hostile_frames(rng: random.Random, valid: list[bytes], n: int) -> list[list[bytes]]:
    """``n`` messages: mutations of a valid one, invalid UTF-8, garbage, wrong frame counts."""
    out = []
    for i in range(n):
        choice = i % 5
        frames = list(valid)
        if choice == 0:  # flip bytes of the body
            body = bytearray(frames[2])
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            frames[2] = bytes(body)
        elif choice == 1:  # a string field that is not UTF-8
            frames[2] = frames[2].replace(b"\xa1k", b"\xa2\xff\xfe", 1)
        elif choice == 2:
            frames[2] = rng.randbytes(rng.randint(0, 64))
        elif choice == 3:
            frames = [GUARD, rng.randbytes(5)] + frames[2:]
        else:  # a forged, well-formed message of another transfer
            frames = make_codec("").encode(_done(i))
        out.append(frames)
    return out


def _server(codec_secret: str, host: str, delivered: list):
    hport, nport = _free_ports(2)
    ctx = zmq.Context()
    server = ControlServer(make_codec(codec_secret), ctx, host, hport, nport, _metadata, delivered.append, "test-side")
    return ctx, server, hport, nport


def _push(ctx, port: int, secret: str):
    """A PUSH socket towards ``port``, authenticated at the connection with ``secret`` ("" = none)."""
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 0)
    secure_client(push, secret.encode(), make_codec(secret).max_frame_bytes)
    push.connect(f"tcp://127.0.0.1:{port}")
    return push


def test_forged_frames_with_a_secret_deliver_nothing_and_log_little(caplog) -> None:
    """10,000 hostile frames: with a secret none is delivered (item 6), the listener stays
    up and answers a legitimate handshake, and the log gets a few lines (item 9).

    An outsider without the secret does not get past the connection (issue #29 item 2:
    CURVE), so nothing of it is even decoded; the same frames sent over an authenticated
    connection (as if that layer were bypassed) are refused by the codec one by one."""
    delivered: list = []
    ctx, server, hport, nport = _server("s3cret", "127.0.0.1", delivered)
    outsider, insider = _push(ctx, nport, ""), _push(ctx, nport, "s3cret")
    try:
        caplog.set_level(logging.WARNING)
        rng = random.Random(21)
        hostile = _hostile_frames(rng, make_codec("").encode(_done(0)), 10_000)
        for frames in hostile:
            try:
                outsider.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # its connection never came up: nothing to queue on
                break
        time.sleep(1.0)
        assert server.bad_messages.events == 0 and not delivered, "an outsider's frame reached the decoder"
        for frames in hostile:
            insider.send_multipart(frames)
        insider.send_multipart(make_codec("s3cret").encode(_done(99), recipient=notify_recipient("127.0.0.1", nport)))
        deadline = time.monotonic() + 30
        while not delivered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert delivered == [_done(99)], f"{len(delivered)} delivered"
        meta = fetch_metadata(make_codec("s3cret"), ctx, "127.0.0.1", hport, "tester", 10.0)
        assert meta.engine_id == "e"
        lines = [r for r in caplog.records if "dropped a control message" in r.getMessage()]
        assert 1 <= len(lines) <= 3, f"{len(lines)} log lines for 10,000 bad frames"
        assert server.bad_messages.events >= 10_000
    finally:
        outsider.close(0)
        insider.close(0)
        server.close()
        ctx.term()


def test_a_notification_for_another_notify_port_is_refused() -> None:
    """Issue #29 item 1 on the PD side: a notification signed for one worker's notify port,
    replayed to another worker with the same secret, is dropped there."""
    a_got: list = []
    b_got: list = []
    ctx_a, server_a, _, a_port = _server("s3cret", "127.0.0.1", a_got)
    ctx_b, server_b, _, b_port = _server("s3cret", "127.0.0.1", b_got)
    push_a, push_b = _push(ctx_a, a_port, "s3cret"), _push(ctx_b, b_port, "s3cret")
    try:
        captured = make_codec("s3cret").encode(_done(7), recipient=notify_recipient("127.0.0.1", a_port))
        push_a.send_multipart(captured)
        push_b.send_multipart(captured)
        deadline = time.monotonic() + 10
        while (not a_got or server_b.bad_messages.events < 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a_got == [_done(7)] and b_got == [] and server_b.bad_messages.events == 1
    finally:
        push_a.close(0)
        push_b.close(0)
        server_a.close()
        server_b.close()
        ctx_a.term()
        ctx_b.term()


def test_invalid_utf8_frames_do_not_log_tracebacks(caplog) -> None:
    """Item 9: without a secret, invalid-UTF-8 frames are dropped with a rate-limited
    warning, never a traceback per frame; a valid notification still arrives."""
    delivered: list = []
    ctx, server, _, nport = _server("", "127.0.0.1", delivered)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{nport}")
    try:
        caplog.set_level(logging.WARNING)
        valid = make_codec("").encode(_done(0))
        bad = [valid[0], valid[1], valid[2].replace(b"\xa1k", b"\xa2\xff\xfe", 1)]
        assert bad[2] != valid[2]
        for _ in range(2000):
            push.send_multipart(bad)
        push.send_multipart(valid)
        deadline = time.monotonic() + 30
        while not delivered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert delivered == [_done(0)]
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 3
    finally:
        push.close(0)
        server.close()
        ctx.term()


def test_unauthenticated_side_channel_beyond_loopback_warns_at_start(caplog) -> None:
    """Item 6: without a secret any peer can send valid notifications; the server says so
    once at start when it binds a non-loopback address (and not on loopback or with a secret)."""
    host = detect_local_ip()
    if host.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    caplog.set_level(logging.WARNING)
    for secret, bind, expect in (("", host, True), ("", "127.0.0.1", False), ("s3cret", host, False)):
        caplog.clear()
        ctx, server, _, _ = _server(secret, bind, [])
        server.close()
        ctx.term()
        warned = [r for r in caplog.records if "without authentication" in r.getMessage()]
        assert len(warned) == (1 if expect else 0), (secret, bind, warned)


def test_the_same_host_inbox_checks_what_the_notify_port_checks(caplog) -> None:
    """The same-host inbox (common.local_inbox) is another wire to the same decoder: with a
    secret, 10,000 hostile datagrams (the frames above, unsigned or for another port, plus
    broken framing) deliver nothing, log a few lines and leave it serving; a signed
    notification for this notify port comes through it; a peer with no inbox here makes the
    sender fall back to ZMQ."""
    from mori_integrations.common.local_inbox import LocalSender, inbox_name, pack_frames, try_inbox
    from mori_integrations.vllm.kv_connector.control import Notifier

    delivered: list = []
    hport, nport = _free_ports(2)
    ctx = zmq.Context()
    name = inbox_name(f"test-inbox-{hport}")
    inbox = try_inbox(name)
    assert inbox is not None
    server = ControlServer(make_codec("s3cret"), ctx, "127.0.0.1", hport, nport, _metadata, delivered.append,
                           "test-inbox", inbox=inbox)
    sender = LocalSender()
    try:
        caplog.set_level(logging.WARNING)
        rng = random.Random(5)
        hostile = _hostile_frames(rng, make_codec("").encode(_done(0)), 9_000)
        other_port = make_codec("s3cret").encode(_done(7), recipient=notify_recipient("127.0.0.1", nport + 1))
        deadline = time.monotonic() + 60

        def send(frames) -> None:  # a full queue refuses (the notifier would use ZMQ): wait for room
            while not sender.send(name, frames):
                assert time.monotonic() < deadline, "the inbox stopped draining"
                time.sleep(0.001)

        junk = (b"", b"MKI1", b"MKI1\x02\x00\x05\x00\x00\x00", pack_frames([b"a"])[:-1]) * 125
        for frames in hostile + [other_port] * 500 + [[j] for j in junk]:  # [j]: a payload not ours
            send(frames)
        sent = len(hostile) + 500 + len(junk)
        send(make_codec("s3cret").encode(_done(99), recipient=notify_recipient("127.0.0.1", nport)))
        while (not delivered or server.bad_messages.events < sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.bad_messages.events == sent, (server.bad_messages.events, sent)
        assert delivered == [_done(99)], f"{len(delivered)} delivered"
        assert server.inbox_messages == 1
        lines = [r for r in caplog.records if "dropped a control message" in r.getMessage()]
        assert 1 <= len(lines) <= 3, f"{len(lines)} log lines for {sent} bad datagrams"
        # No inbox of that name on this host: the notifier falls back to the notify port (ZMQ).
        notifier = Notifier(make_codec("s3cret"), ctx, LocalSender())
        try:
            assert notifier.send("127.0.0.1", nport, _done(100), inbox=inbox_name("no-such-engine"))
            while len(delivered) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert delivered[1:] == [_done(100)] and server.inbox_messages == 1
        finally:
            notifier.close()
    finally:
        sender.close()
        server.close()
        ctx.term()


def test_control_thread_spins_only_after_expect_and_delivers_throughout() -> None:
    """``expect()`` makes the control thread poll (no blocking sleep) for ``spin_s`` after it,
    and after every message it handles; then it blocks again. Notifications arrive in order
    while it spins, after it went back to sleep, and when expect() wakes it from a blocking poll."""
    delivered: list = []
    hport, nport = _free_ports(2)
    ctx = zmq.Context()
    server = ControlServer(make_codec(""), ctx, "127.0.0.1", hport, nport, _metadata, delivered.append,
                           "test-spin", spin_s=0.3)
    push = _push(ctx, nport, "")
    to_me = notify_recipient("127.0.0.1", nport)

    def wait_for(cond, timeout=10.0) -> bool:
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.005)
        return cond()

    try:
        assert wait_for(lambda: server._blocked), "a fresh server must sleep in a blocking poll"
        server.expect()
        assert wait_for(lambda: not server._blocked, 1.0), "expect() did not wake the thread"
        for i in range(20):
            push.send_multipart(make_codec("").encode(_done(i), recipient=to_me))
            time.sleep(0.01)
        assert wait_for(lambda: len(delivered) == 20)
        assert not server._blocked  # still inside the window the last message opened
        assert wait_for(lambda: server._blocked, 2.0), "the thread kept spinning after its window"
        push.send_multipart(make_codec("").encode(_done(20), recipient=to_me))
        assert wait_for(lambda: len(delivered) == 21)
        assert delivered == [_done(i) for i in range(21)]
    finally:
        push.close(0)
        server.close()
        ctx.term()
