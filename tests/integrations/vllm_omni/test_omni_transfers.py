"""put/get between processes through the real connector, vLLM-Omni 0.30's factory and
mori-suite's IO engine over its TCP backend (CPU pools).

Covers payload sizes (seed 004's 3.3 KB and 1.6 MB, and 64 MB), raw tensors /
bytes and serialised objects, concurrent keys, the three kinds of metadata,
malformed control messages, a busy port, and per-TP-rank ports. Slow or dead
peers are in test_omni_failures.py.
"""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from omni_workers import digest, find_free_base, make_payload, wait_until
from mori_integrations.common.control_codec import PIECE_BYTES
from mori_integrations.vllm_omni import protocol

SEED_004_SIZES = [3305, 1_611_713]  # 3.3 KB (talker -> code2wav), 1.6 MB (thinker -> talker)
LARGE = 64 << 20


def sender_extra(port: int, **kw: object) -> dict:
    extra = {"host": "127.0.0.1", "zmq_port": port, "role": "sender", "memory_pool_size": "200M"}
    extra.update(kw)
    return extra


def receiver_extra(port: int, **kw: object) -> dict:
    extra = {"host": "127.0.0.1", "role": "receiver", "sender_host": "127.0.0.1", "sender_zmq_port": port,
             "memory_pool_size": "200M"}
    extra.update(kw)
    return extra


@pytest.fixture(scope="module")
def pair(omni_procs):
    """A sender and a receiver connector in two of the shared stage processes."""
    snd, rcv = omni_procs[0], omni_procs[1]
    port = find_free_base(1)
    info = snd.call("create", cid="s", extra=sender_extra(port))
    assert info["class"] == "mori_integrations.vllm_omni.connector.MoriTransferEngineConnector"
    rcv.call("create", cid="r", extra=receiver_extra(port))
    yield snd, rcv, port
    snd.call("close", cid="s")
    rcv.call("close", cid="r")


@pytest.mark.parametrize("nbytes", SEED_004_SIZES + [LARGE], ids=["3.3KB", "1.6MB", "64MB"])
@pytest.mark.parametrize("kind", ["tensor", "bytes", "object"])
def test_put_get_between_processes(pair, kind: str, nbytes: int) -> None:
    snd, rcv, _ = pair
    key = f"{kind}-{nbytes}"
    put = snd.call("put", cid="s", frm="0", to="1", key=key, kind=kind, nbytes=nbytes, seed=nbytes % 97)
    assert put["ok"] and put["md"]["data_size"] == put["size"]
    assert put["md"]["is_fast_path"] is (kind != "object")
    got = rcv.call("get", cid="r", frm="0", to="1", key=key, md=put["md"])
    assert got["found"] and got["size"] == put["size"]
    assert got["digest"] == put["digest"]
    assert got["kind"] == ("buffer" if kind != "object" else "dict")
    # Consumed: the sender freed it, a second get finds nothing.
    assert not rcv.call("get", cid="r", frm="0", to="1", key=key, md=None)["found"]
    s_health, r_health = snd.call("health", cid="s"), rcv.call("health", cid="r")
    assert s_health["pool_used_bytes"] == 0 and r_health["pool_used_bytes"] == 0
    assert s_health["routes"].get("TCP", 0) >= 1


def test_partial_and_missing_metadata_query_the_sender(pair) -> None:
    snd, rcv, port = pair
    a = snd.call("put", cid="s", frm="0", to="1", key="partial", kind="object", nbytes=3305, seed=1)
    b = snd.call("put", cid="s", frm="0", to="1", key="none", kind="tensor", nbytes=1_611_712, seed=2)
    # Only host/port, as the KV manager and vLLM-Omni 0.30's chunk/model-runner paths send it.
    got = rcv.call("get", cid="r", frm="0", to="1", key="partial",
                   md={"source_host": "127.0.0.1", "source_port": port})
    assert got["found"] and got["digest"] == a["digest"]
    # No metadata: the configured sender (sender_host/sender_zmq_port) is queried.
    got = rcv.call("get", cid="r", frm="0", to="1", key="none", md=None)
    assert got["found"] and got["digest"] == b["digest"]
    # Not put yet: None, quickly (callers poll).
    got = rcv.call("get", cid="r", frm="0", to="1", key="later", md={"source_host": "127.0.0.1", "source_port": port})
    assert not got["found"] and got["elapsed_s"] < 2.0


def test_concurrent_keys(pair) -> None:
    snd, rcv, _ = pair
    puts = []
    for i in range(24):
        kind = ("tensor", "bytes", "object")[i % 3]
        nbytes = (1024, 3305, 65536, 1_611_713)[i % 4]
        puts.append(snd.call("put", cid="s", frm="0", to="1", key=f"c{i}", kind=kind, nbytes=nbytes, seed=i))
    items = [(f"c{i}", p["md"] if i % 2 else None) for i, p in enumerate(puts)]
    results = rcv.call("get_many", cid="r", frm="0", to="1", items=items, threads=6)
    for i, (p, r) in enumerate(zip(puts, results)):
        assert r["found"], (i, r)
        assert r["digest"] == p["digest"], i
    assert snd.call("health", cid="s")["outbox_entries"] == 0
    assert rcv.call("health", cid="r")["pool_used_bytes"] == 0


def test_cleanup_withdraws_a_payload(pair) -> None:
    snd, rcv, _ = pair
    put = snd.call("put", cid="s", frm="0", to="1", key="gone", kind="bytes", nbytes=5000, seed=3)
    assert snd.call("cleanup", cid="s", key="gone", frm="0", to="1") is True
    assert snd.call("cleanup", cid="s", key="gone", frm="0", to="1") is False
    assert not rcv.call("get", cid="r", frm="0", to="1", key="gone", md=put["md"])["found"]
    assert snd.call("health", cid="s")["pool_used_bytes"] == 0


def test_a_released_zero_copy_buffer_stays_pinned_until_pulled(pair) -> None:
    """Issue #29 item 6: main let the next allocation overwrite it; the receiver got b'BBBB' for b'AAAA'."""
    snd, rcv, _ = pair
    nbytes = 3 * 4096
    put = snd.call("put_own_buffer_and_release", cid="s", frm="0", to="1", key="own", nbytes=nbytes, seed=29)
    assert put["ok"] and put["size"] == nbytes
    assert not put["reused"], "the next allocation got the released, still published bytes"
    assert put["used_bytes"] == 2 * nbytes  # the published range is held, the new payload lies beside it
    got = rcv.call("get", cid="r", frm="0", to="1", key="own", md=put["md"])
    assert got["found"] and got["digest"] == put["digest"], "the receiver got other bytes than were put"
    # Pulled: the hold ended and the bytes went back to the pool; only the second payload remains.
    assert wait_until(lambda: snd.call("health", cid="s")["pool_used_bytes"] == nbytes, 10)
    snd.call("release_reserved", cid="s", key="own")
    assert snd.call("health", cid="s")["pool_used_bytes"] == 0


def _raw_request(port: int, frames: list[bytes], timeout_s: float = 5.0):
    """Send raw frames to a listener; the decoded reply, or None if none came."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return protocol.make_codec().decode(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def test_malformed_control_messages_get_clear_errors_and_change_nothing(pair) -> None:
    snd, rcv, port = pair
    put = snd.call("put", cid="s", frm="0", to="1", key="target", kind="bytes", nbytes=3305, seed=9)
    key = "target@0_1"
    r_desc = rcv.call("reserve", cid="r", size=3305)
    before = snd.call("health", cid="s")["malformed_requests"]

    def pull(**kw: object) -> list[bytes]:
        fields = dict(seq=7, key=key, engine_desc=r_desc["engine_desc"], mem_desc=r_desc["mem_desc"],
                      dst_offset=r_desc["offset"], length=3305)
        fields.update(kw)
        return [protocol.GUARD, b"PULL", msgspec.msgpack.encode(fields)]

    def query(body: object) -> list[bytes]:
        return [protocol.GUARD, b"QUERY", body if isinstance(body, bytes) else msgspec.msgpack.encode(body)]

    cases = {
        "garbage": [b"\xc1\xff not msgpack"],
        "garbage body": query(b"\xc1\xff not msgpack"),
        "wrong shape": query({"seq": 1}),
        "unknown kind": [protocol.GUARD, b"DELETE", msgspec.msgpack.encode({"seq": 1, "key": key})],
        "key too long": query({"seq": 1, "key": "k" * 5000}),
        "key not UTF-8": query(b"\x82\xa3seq\x01\xa3key\xa2\xff\xfe"),
        "a reply": [protocol.GUARD, b"NOTFOUND", msgspec.msgpack.encode({"seq": 1, "key": key})],
        "negative offset": pull(dst_offset=-4096),
        "zero length": pull(length=0),
        # bodies travel in frames of at most PIECE_BYTES: a body over the limit in frames within the bound
        "over message limit": query(b"\x00" * PIECE_BYTES) + [b"\x00" * PIECE_BYTES, b"\x00" * 100],
        "two frames": [b"a", b"b"],
    }
    for name, frames in cases.items():
        reply = _raw_request(port, frames)
        assert isinstance(reply, protocol.Rejected), (name, reply)
        assert reply.reason, name
    # A frame above the frame bound (a piece + 1 KiB) makes ZMQ drop the peer at the frame
    # header: no reply, no memory spent, listener alive.
    assert _raw_request(port, query(b"\x00" * (PIECE_BYTES + 2048)), timeout_s=1.0) is None
    assert _raw_request(port, query(b"\x00" * (8 << 20)), timeout_s=1.0) is None

    # Well-formed but wrong: answered with a reason, the payload stays offered.
    wrong_len = _raw_request(port, pull(length=3306))
    assert isinstance(wrong_len, protocol.PullResponse) and not wrong_len.ok
    assert "payload is 3305 bytes" in wrong_len.error
    bad_desc = _raw_request(port, pull(engine_desc=b"\x93not an engine", mem_desc=b"\x01"))
    assert isinstance(bad_desc, protocol.PullResponse) and not bad_desc.ok
    assert "bad receiver descriptor" in bad_desc.error
    out_of_bounds = _raw_request(port, pull(dst_offset=r_desc["pool_size"]))
    assert isinstance(out_of_bounds, protocol.PullResponse) and not out_of_bounds.ok
    assert "ERR_INVALID_ARGS" in out_of_bounds.error

    health = snd.call("health", cid="s")
    assert health["malformed_requests"] - before == len(cases)
    assert health["listener_alive"] and health["outbox_entries"] >= 1
    rcv.call("reserved_digest", cid="r")
    got = rcv.call("get", cid="r", frm="0", to="1", key="target", md=put["md"])
    assert got["found"] and got["digest"] == put["digest"]


def test_busy_port_fails_fast_and_tp_ranks_get_their_own_ports(pair, free_base_port) -> None:
    proc = pair[0]
    base = free_base_port(40)
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", base))
    holder.listen(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            proc.call("create", cid="busy", extra=sender_extra(base, memory_pool_size="1M"))
        assert time.monotonic() - t0 < 10
        assert f"cannot listen on tcp://127.0.0.1:{base}" in str(err.value)
        assert "Address already in use" in str(err.value)
        # Same base port, TP ranks 1 and 2: distinct ports (base+16, base+32), both bind.
        for rank in (1, 2):
            info = proc.call("create", cid=f"s{rank}", extra=sender_extra(base, tp_rank=rank, memory_pool_size="1M"))
            assert info["info"]["zmq_port"] == base + 16 * rank
        # The TP-rank-2 receiver finds the TP-rank-2 sender through the same base port.
        put = proc.call("put", cid="s2", frm="0", to="1", key="tp", kind="bytes", nbytes=4000, seed=5)
        proc.call("create", cid="r2", extra=receiver_extra(base, tp_rank=2, memory_pool_size="1M"))
        got = proc.call("get", cid="r2", frm="0", to="1", key="tp", md=None)
        assert got["found"] and got["digest"] == put["digest"]
        # A middle stage whose derived port is busy: put fails (no silent fallback).
        proc.call("create", cid="mid", extra=receiver_extra(base - 1, from_stage=0, stage_id=1,
                                                            memory_pool_size="1M"))
        assert proc.call("put", cid="mid", frm="1", to="2", key="x", kind="bytes", nbytes=10, seed=1)["ok"] is False
    finally:
        holder.close()


def test_close_is_idempotent_and_releases_the_pool(pair, free_base_port) -> None:
    base = free_base_port(4)
    snd, rcv, _ = pair
    snd.call("create", cid="cs", extra=sender_extra(base, memory_pool_size="4M"))
    rcv.call("create", cid="cr", extra=receiver_extra(base, memory_pool_size="4M"))
    put = snd.call("put", cid="cs", frm="0", to="1", key="a", kind="bytes", nbytes=5000, seed=1)
    assert rcv.call("get", cid="cr", frm="0", to="1", key="a", md=put["md"])["found"]
    assert snd.call("health", cid="cs")["remote_engines"] == 1
    desc = rcv.call("reserve", cid="cr", size=5000)
    snd.call("put", cid="cs", frm="0", to="1", key="b", kind="bytes", nbytes=5000, seed=2)
    assert rcv.call("close", cid="cr") == {"status": "closed"}
    # The closed receiver's pool is gone from its engine: a write into it fails cleanly.
    pull = protocol.make_codec().encode(protocol.PullRequest(
        seq=1, key="b@0_1", engine_desc=desc["engine_desc"], mem_desc=desc["mem_desc"], dst_offset=desc["offset"],
        length=5000))
    reply = _raw_request(base, pull, timeout_s=30)
    assert isinstance(reply, protocol.PullResponse) and not reply.ok
    assert snd.call("close", cid="cs") == {"status": "closed"}
    assert "closed" in snd.call("call_after_close", cid="cs")
    # The sender's listener port is free again.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", base))


def test_make_payload_object_digest_is_canonical() -> None:
    a, b = make_payload("object", 3305, 4), make_payload("object", 3305, 4)
    assert digest(a) == digest(b) != digest(make_payload("object", 3305, 5))
