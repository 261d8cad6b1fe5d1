"""The Omni control plane under hostile input (issue #21 items 1-4, deliverable 2).

Real connectors in stage processes (omni_workers.StageProc) over real ZMQ and
IO-engine sockets; the attacker is this test process, speaking the wire format.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from test_omni_failures import receiver_extra, sender_extra

GUARD = b"MoriSuiteOmni1"
SECRET = "omni-s3cret"
# {"seq": 1, "key": "\xff\xfe"} with a key that is not UTF-8 (msgspec cannot encode it)
BAD_UTF8_QUERY = b"\x82\xa3seq\x01\xa3key\xa2\xff\xfe"
# the same as the single-frame message of the protocol before the shared codec
BAD_UTF8_QUERY_V0 = b"\x83\xa4type\xa5query\xa3seq\x01\xa3key\xa2\xff\xfe"


def _codec(secret: str = ""):
    from mori_integrations.vllm_omni import protocol

    return protocol.make_codec(secret)


def _send(port: int, frames: list[bytes], timeout_s: float = 5.0, keys_of: str = ""):
    """Send raw frames to a sender's listener; the raw reply frames, or None.

    ``keys_of``: connect with the CURVE keys of this secret, i.e. past the connection-level
    authentication (an insider, or an attacker who got through it); "" = none, as an outsider.
    """
    from mori_integrations.common.zmq_setup import secure_client

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, keys_of.encode(), 1 << 20)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return None
        return sock.recv_multipart() if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close(linger=0)


def _pull_frames(codec, key: str, desc: dict, length: int, seq: int = 1, port: int = 0) -> list[bytes]:
    """A pull for the receiver described by ``desc``, bound to the sender listening on ``port``."""
    from mori_integrations.vllm_omni import protocol

    return codec.encode(protocol.PullRequest(seq=seq, key=key, engine_desc=desc["engine_desc"],
                                             mem_desc=desc["mem_desc"], dst_offset=desc["offset"], length=length),
                        recipient=f"tcp://127.0.0.1:{port}")


def _v0_pull(key: str, desc: dict, length: int, seq: int = 1) -> list[bytes]:
    """The same pull in the single-frame format used before the shared codec (refused now)."""
    return [msgspec.msgpack.encode({"type": "pull", "seq": seq, "key": key, "engine_desc": desc["engine_desc"],
                                    "mem_desc": desc["mem_desc"], "dst_offset": desc["offset"], "length": length})]


def test_one_invalid_utf8_frame_does_not_kill_the_listener(omni_procs, free_base_port) -> None:
    """Item 1: a query whose key is not UTF-8 used to end the listener thread."""
    snd, rcv = omni_procs[0], omni_procs[1]
    port = free_base_port(1)
    snd.call("create", cid="utf_s", extra=sender_extra(port))
    rcv.call("create", cid="utf_r", extra=receiver_extra(port))
    put = snd.call("put", cid="utf_s", frm="0", to="1", key="after", kind="bytes", nbytes=3305, seed=4)
    _send(port, [BAD_UTF8_QUERY_V0], timeout_s=1.0)
    _send(port, [GUARD, b"QUERY", BAD_UTF8_QUERY], timeout_s=1.0)
    time.sleep(0.2)
    assert snd.call("health", cid="utf_s")["listener_alive"]
    got = rcv.call("get", cid="utf_r", frm="0", to="1", key="after", md=put["md"])
    assert got["found"] and got["digest"] == put["digest"]
    assert got["elapsed_s"] < 2.0


def test_with_a_secret_forged_replayed_and_foreign_pulls_are_refused(omni_procs, free_base_port) -> None:
    """Items 2 and 3, deliverable 2: with auth_secret an outsider can neither take a
    payload nor make the sender write into a receiver's pool (confused deputy), and a
    captured pull cannot be replayed; the real receiver still gets its payload.

    An outsider does not get past the connection (CURVE, issue #29 item 2): no answer at
    all. The message-level checks are shown over an authenticated connection."""
    snd, rcv = omni_procs[0], omni_procs[1]
    port = free_base_port(1)
    snd.call("create", cid="sec_s", extra=sender_extra(port, auth_secret=SECRET))
    rcv.call("create", cid="sec_r", extra=receiver_extra(port, auth_secret=SECRET))
    put1 = snd.call("put", cid="sec_s", frm="0", to="1", key="one", kind="bytes", nbytes=3305, seed=1)
    put2 = snd.call("put", cid="sec_s", frm="0", to="1", key="two", kind="bytes", nbytes=3305, seed=2)
    victim = rcv.call("reserve", cid="sec_r", size=3305)  # a real receiver's buffer, descriptors in clear

    def refused(frames: list[bytes]) -> str:
        assert _send(port, frames, timeout_s=1.0) is None, "an outsider got an answer"
        reply = _send(port, frames, keys_of=SECRET)
        assert reply is not None, "no answer"
        message = msgspec.msgpack.decode(reply[2])
        assert reply[1] == b"REJECT", (reply[1], message)
        return message["reason"]

    assert "not a mori-suite control message" in refused(_v0_pull("two@0_1", victim, 3305))
    assert "unauthenticated" in refused(_pull_frames(_codec(), "two@0_1", victim, 3305, port=port))  # item 3
    assert "bad authentication" in refused(_pull_frames(_codec("wrong"), "two@0_1", victim, 3305, port=port))
    query = _codec().encode(__import__("mori_integrations.vllm_omni.protocol", fromlist=["x"]).QueryRequest(
        seq=5, key="two@0_1"))
    assert "unauthenticated" in refused(query)
    # A pull signed with the secret (as if captured on the wire) works once, never twice.
    signed = _pull_frames(_codec(SECRET), "one@0_1", victim, 3305, port=port)
    codec = _codec(SECRET)
    first = codec.decode(_send(port, signed, keys_of=SECRET), recipient=codec.reply_binding(signed))
    assert first.ok, first
    assert "replayed" in refused(signed)
    assert rcv.call("reserved_digest", cid="sec_r") == put1["digest"]  # only the signed pull wrote
    # The real receiver gets its payload; nothing forged consumed it.
    got = rcv.call("get", cid="sec_r", frm="0", to="1", key="two", md=put2["md"])
    assert got["found"] and got["digest"] == put2["digest"]
    health = snd.call("health", cid="sec_s")
    assert health["malformed_requests"] >= 4 and health["listener_alive"]


def test_a_pull_replayed_to_another_sender_is_refused(omni_procs, free_base_port) -> None:
    """Issue #29 item 1: two sender processes share the secret and both hold a payload under
    the same key and length (say two TP ranks publishing one request id). A pull captured on
    its way to the first one and sent to the second used to be accepted there (the seen-nonce
    set is per process): the receiver's buffer was overwritten and its own pull from the
    second sender found nothing. Now the pull is bound to the first sender's address."""
    s1, rcv, s2 = omni_procs[0], omni_procs[1], omni_procs[2]
    port1, port2 = free_base_port(1), free_base_port(1)
    s1.call("create", cid="rp_s1", extra=sender_extra(port1, auth_secret=SECRET))
    s2.call("create", cid="rp_s2", extra=sender_extra(port2, auth_secret=SECRET))
    rcv.call("create", cid="rp_r", extra=receiver_extra(port1, auth_secret=SECRET))
    put1 = s1.call("put", cid="rp_s1", frm="0", to="1", key="req", kind="bytes", nbytes=4096, seed=21)
    put2 = s2.call("put", cid="rp_s2", frm="0", to="1", key="req", kind="bytes", nbytes=4096, seed=22)
    assert put1["digest"] != put2["digest"] and put1["size"] == put2["size"]
    victim = rcv.call("reserve", cid="rp_r", size=4096)
    codec = _codec(SECRET)
    captured = _pull_frames(codec, "req@0_1", victim, 4096, port=port1)  # what the receiver sends to s1
    first = codec.decode(_send(port1, captured, keys_of=SECRET), recipient=codec.reply_binding(captured))
    assert first.ok, first

    def replay(port: int) -> str:
        reply = _send(port, captured, keys_of=SECRET)
        assert reply is not None and reply[1] == b"REJECT", reply
        return msgspec.msgpack.decode(reply[2])["reason"]

    assert "replayed" in replay(port1)
    assert f"addressed to 'tcp://127.0.0.1:{port1}', not to 'tcp://127.0.0.1:{port2}'" in replay(port2)
    assert _send(port2, captured, timeout_s=1.0) is None  # an outsider does not even get an answer
    assert rcv.call("reserved_digest", cid="rp_r") == put1["digest"]  # the receiver's buffer is untouched
    got = rcv.call("get", cid="rp_r", frm="0", to="1", key="req", md=put2["md"])  # its own pull from s2
    assert got["found"] and got["digest"] == put2["digest"]
    assert s2.call("health", cid="rp_s2")["bytes_sent"] == 4096  # s2 wrote once: for the receiver's own pull


def test_forged_pulls_cannot_fill_the_engine_table(omni_procs, free_base_port) -> None:
    """Item 4: 1,030 forged pulls, each naming another engine, used to fill the sender's
    1,024-entry engine table and lock out new receivers. With a secret they are refused
    before anything is registered; a new receiver still fetches."""
    snd, rcv = omni_procs[0], omni_procs[2]
    port = free_base_port(1)
    snd.call("create", cid="fill_s", extra=sender_extra(port, auth_secret=SECRET))
    put = snd.call("put", cid="fill_s", frm="0", to="1", key="bait", kind="bytes", nbytes=3305, seed=3)
    rcv.call("create", cid="fill_probe", extra=receiver_extra(port, auth_secret=SECRET))
    desc = rcv.call("reserve", cid="fill_probe", size=3305)
    from mori_integrations.common.zmq_setup import secure_client

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, SECRET.encode(), 1 << 20)  # past the connection-level authentication
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        for i in range(1030):
            fake = dict(desc, engine_desc=desc["engine_desc"].replace(b"omni-receiver", f"x{i:012d}".encode(), 1))
            sock.send_multipart(_pull_frames(_codec(), "bait@0_1", fake, 3305, seq=i + 1, port=port))
            sock.send_multipart(_v0_pull("bait@0_1", fake, 3305, seq=i + 1))
        answers = 0
        deadline = time.monotonic() + 60
        while answers < 2060 and time.monotonic() < deadline:
            if sock.poll(1000):
                sock.recv_multipart()
                answers += 1
    finally:
        sock.close(linger=0)
    assert answers == 2060
    assert snd.call("health", cid="fill_s")["remote_engines"] == 0
    rcv.call("create", cid="fill_r", extra=receiver_extra(port, auth_secret=SECRET))
    got = rcv.call("get", cid="fill_r", frm="0", to="1", key="bait", md=put["md"])
    assert got["found"] and got["digest"] == put["digest"]


def test_engine_table_evicts_idle_engines_and_never_busy_ones() -> None:
    """Item 4 without a secret: the table is an LRU; an engine a pull is using is never
    evicted, an idle one is (so receivers that come and go cannot lock new ones out)."""
    from mori_core import io
    from mori_integrations.vllm_omni.peers import RemoteEngines

    engine = io.IOEngine("lru-owner", io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(io.BackendType.TCP)
    others = []
    for i in range(4):
        e = io.IOEngine(f"lru-peer-{i}", io.IOEngineConfig("127.0.0.1", 0))
        e.create_backend(io.BackendType.TCP)
        others.append(e)
    table = RemoteEngines(engine, io, capacity=3)
    packed = [e.get_engine_desc().pack() for e in others]
    for p in packed[:3]:
        table.release(table.acquire(p).key)
    busy = table.acquire(packed[0])  # in use from here on; now the most recently used
    assert table.acquire(packed[3]).key == "lru-peer-3"  # evicts lru-peer-1, the least recently used idle one
    assert len(table) == 3 and table.evicted == 1
    table.acquire(packed[2])  # all three in use now
    with pytest.raises(RuntimeError, match="all in use"):
        table.acquire(packed[1])
    table.release(busy.key)
    assert table.acquire(packed[1]).key == "lru-peer-1"  # lru-peer-0 was idle again: evicted
    assert table.evicted == 2


def test_unauthenticated_listener_beyond_loopback_warns_at_start(caplog) -> None:
    """Item 2: without a secret the default stays open; the connector says so once at
    start when it listens beyond loopback."""
    import logging

    from mori_integrations.common.net import detect_local_ip
    from mori_integrations.vllm_omni.settings import ConnectorSettings
    from mori_integrations.vllm_omni.transport import OmniTransport
    from omni_workers import find_free_base

    host = detect_local_ip()
    if host.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    caplog.set_level(logging.WARNING)
    for secret, bind, expect in (("", host, 1), ("", "127.0.0.1", 0), (SECRET, host, 0)):
        caplog.clear()
        t = OmniTransport(ConnectorSettings.from_extra({"host": bind, "zmq_port": find_free_base(1), "role": "sender",
                                                        "memory_pool_size": "1M", "auth_secret": secret}))
        t.close()
        assert len([r for r in caplog.records if "without authentication" in r.getMessage()]) == expect, (secret, bind)
