"""Unit tests of the connector's own logic: settings, wire protocol, allocator, outbox.

No vLLM-Omni import and no transport here; the multi-process tests cover those.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from mori_integrations.vllm_omni import protocol
from mori_integrations.vllm_omni.outbox import KeyBusyError, Outbox, PullRefused
from mori_integrations.vllm_omni.pool import BufferAllocator, MemoryPool
from mori_integrations.vllm_omni.settings import ConnectorSettings


# ------------------------------------------------------------------ settings
def test_settings_stock_keys_and_defaults() -> None:
    s = ConnectorSettings.from_extra({"host": "127.0.0.1", "zmq_port": 50051, "backend_type": "xgmi",
                                      "memory_pool_device": "cuda", "memory_pool_size": 536870912,
                                      "xgmi_num_streams": 8, "codec_chunk_frames": 25})
    assert (s.role, s.listen_port, s.backend_type, s.memory_pool_size) == ("sender", 50051, "xgmi", 512 << 20)
    assert s.xgmi_num_streams == 8 and s.buffer_ttl_seconds == 300.0
    assert ConnectorSettings.from_extra({"memory_pool_size": "64M"}).memory_pool_size == 64 << 20


@pytest.mark.parametrize("extra, needle", [
    ({"role": "both"}, "'role'"),
    ({"zmq_port": 70000}, "['zmq_port'] must be an int in [1, 65535]"),
    ({"memory_pool_size": 10}, "['memory_pool_size'] must be a byte count in [65536"),
    ({"memory_pool_size": "lots"}, "'memory_pool_size'"),
    ({"memory_pool_device": "tpu"}, "'memory_pool_device'"),
    ({"backend_type": "xgmi"}, "needs memory_pool_device 'cuda'"),
    ({"backend_type": "nvlink"}, "'backend_type'"),
    ({"buffer_ttl_seconds": -1}, "'buffer_ttl_seconds'"),
    ({"tp_rank": 4100, "zmq_port": 60000}, "'tp_rank'"),
    ({"tp_rank": 400, "zmq_port": 60000}, "outside [1, 65535]"),
])
def test_settings_reject_bad_values_with_the_key_and_limit(extra: dict, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        ConnectorSettings.from_extra(extra)
    assert needle in str(err.value)


def test_settings_ports_per_tp_rank_and_middle_stage() -> None:
    # TP rank 1 of a sender and of its receiver: both offset by the stride.
    s = ConnectorSettings.from_extra({"role": "sender", "zmq_port": 50051, "tp_rank": 1})
    r = ConnectorSettings.from_extra({"role": "receiver", "sender_zmq_port": 50051, "tp_rank": 1})
    assert s.listen_port == r.sender_zmq_port == 50051 + 16
    # A middle stage as vLLM-Omni 0.30 resolves it: receiver of 0->1 with sender port base+0.
    mid = ConnectorSettings.from_extra({"role": "receiver", "sender_zmq_port": 50051, "from_stage": 0,
                                        "to_stage": 1, "stage_id": 1})
    assert mid.listen_port == 50052  # = the sender_zmq_port vLLM-Omni gives stage 2
    assert ConnectorSettings.from_extra({"role": "receiver"}).listen_port is None
    assert ConnectorSettings.from_extra({"role": "receiver", "outgoing_zmq_port": 40000}).listen_port == 40000


def test_transfer_timeout_grows_with_size() -> None:
    s = ConnectorSettings.from_extra({"transfer_timeout_s": 10, "transfer_timeout_per_100mb_s": 2})
    assert s.transfer_timeout_for(1000) == 10
    assert s.transfer_timeout_for(250_000_000) == 14


# ------------------------------------------------------------------ protocol
def _pull(**kw: object) -> protocol.PullRequest:
    base = dict(seq=1, key="k", engine_desc=b"e", mem_desc=b"m", dst_offset=0, length=10)
    base.update(kw)
    return protocol.PullRequest(**base)


def test_protocol_round_trip() -> None:
    codec = protocol.make_codec()
    for msg in (protocol.QueryRequest(seq=3, key="a@0_1"), _pull(dst_offset=4096, length=3305),
                protocol.QueryResponse(seq=1, key="k", data_size=5, is_fast_path=True),
                protocol.PullResponse(seq=2, key="k", ok=False, error="x", write_pending=True),
                protocol.NotFound(seq=3, key="k"), protocol.Rejected(seq=0, reason="r")):
        assert codec.decode(codec.encode(msg)) == msg


def _frames(kind: bytes, body: object) -> list[bytes]:
    return [protocol.GUARD, kind, body if isinstance(body, bytes) else msgspec.msgpack.encode(body)]


@pytest.mark.parametrize("frames", [
    _frames(b"QUERY", b"\xc1garbage"),
    _frames(b"QUERY", {"seq": 1}),
    _frames(b"QUERY", {"seq": 1, "key": "x" * (protocol.MAX_KEY_CHARS + 1)}),
    _frames(b"QUERY", {"seq": 1, "key": ""}),
    _frames(b"QUERY", b"\x82\xa3seq\x01\xa3key\xa2\xff\xfe"),  # key is invalid UTF-8 (issue #21 item 1)
    _frames(b"PULL", {"seq": 1, "key": "k", "engine_desc": b"e", "mem_desc": b"m", "dst_offset": -1, "length": 10}),
    _frames(b"PULL", {"seq": 1, "key": "k", "engine_desc": b"e", "mem_desc": b"m", "dst_offset": 0, "length": 0}),
    _frames(b"PULL", {"seq": 1, "key": "k", "engine_desc": b"e" * (protocol.MAX_DESC_BYTES + 1), "mem_desc": b"m",
                      "dst_offset": 0, "length": 1}),
    _frames(b"\xff\xfe", {"seq": 1, "key": "k"}),
    _frames(b"QUERY", b"\x00" * (protocol.MAX_FRAME_BYTES + 1)),
    [b"not our guard", b"QUERY", b"x"],
])
def test_protocol_rejects_malformed_messages(frames: list[bytes]) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.make_codec().decode(frames)


def test_protocol_with_a_secret_refuses_forged_replayed_and_foreign_messages() -> None:
    mine, other, none = protocol.make_codec("s3cret"), protocol.make_codec("other"), protocol.make_codec()
    msg = _pull()
    signed = mine.encode(msg)
    assert mine.decode(signed) == msg
    with pytest.raises(protocol.ProtocolError, match="replayed"):
        mine.decode(signed)
    with pytest.raises(protocol.ProtocolError, match="unauthenticated"):
        mine.decode(none.encode(msg))
    with pytest.raises(protocol.ProtocolError, match="bad authentication"):
        mine.decode(other.encode(msg))
    tampered = list(mine.encode(msg))
    tampered[2] = msgspec.msgpack.encode(_pull(dst_offset=4096))
    with pytest.raises(protocol.ProtocolError, match="bad authentication"):
        mine.decode(tampered)


# ----------------------------------------------------------------- allocator
def test_allocator_first_fit_alignment_and_merge() -> None:
    a = BufferAllocator(64 * 1024, alignment=4096)
    x, y, z = a.alloc(1), a.alloc(5000), a.alloc(4096)
    assert (x, y, z) == (0, 4096, 12288)
    a.free(y)
    assert a.alloc(100) == 4096  # first fit reuses the hole
    with pytest.raises(ValueError, match="not allocated"):
        a.free(8192)
    a.free(4096)
    a.free(x)
    a.free(z)
    assert a.free_ranges == [(0, 64 * 1024)] and a.used_bytes == 0
    a.alloc(60 * 1024)
    with pytest.raises(MemoryError, match="transfer pool exhausted"):
        a.alloc(8192)


def test_pool_buffers_views_and_release() -> None:
    pool = MemoryPool(1 << 16, "cpu")
    buf = pool.alloc(16)
    buf.tensor.copy_(torch.arange(16, dtype=torch.uint8))
    assert buf.as_tensor(torch.int32, (4,)).shape == (4,)
    assert buf.to_bytes() == bytes(range(16))
    with pytest.raises(ValueError):
        buf.as_tensor(torch.float32, (5,))
    buf.release()
    buf.release()  # idempotent
    assert pool.allocator.used_bytes == 0
    leaked = pool.alloc(100)
    leaked.leak()
    assert pool.stats()["pool_leaked_bytes"] == 100 and pool.allocator.used_bytes == 4096


# -------------------------------------------------------------------- outbox
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _outbox(ttl: float = 10.0) -> tuple[Outbox, MemoryPool, _Clock]:
    clock = _Clock()
    return Outbox(ttl, clock), MemoryPool(1 << 20, "cpu"), clock


def test_ttl_never_reclaims_a_pinned_buffer() -> None:
    box, pool, clock = _outbox(ttl=10)
    box.add("k", pool.alloc(1000), is_fast_path=True)
    entry = box.pin("k", 1000)
    clock.now = 100
    assert box.sweep() == [] and box.ttl_skipped_in_flight == 1
    assert pool.allocator.used_bytes == 4096  # still there while the write reads it
    box.unpin(entry, consumed=False)  # failed write: kept for a retry ...
    assert box.sweep() == ["k"]  # ... until the TTL reclaims it, now that nothing reads it
    assert pool.allocator.used_bytes == 0


def test_cleanup_of_a_pinned_buffer_is_deferred_and_hides_the_key() -> None:
    box, pool, _ = _outbox()
    box.add("k", pool.alloc(1000), is_fast_path=False)
    e1 = box.pin("k", 1000)
    e2 = box.pin("k", 1000)  # overlapping pulls of one key
    assert box.discard("k") is True
    assert box.info("k") is None
    with pytest.raises(PullRefused) as refused:
        box.pin("k", 1000)
    assert refused.value.not_found
    box.unpin(e1, consumed=True)
    assert pool.allocator.used_bytes == 4096  # e2 still reads it
    box.unpin(e2, consumed=False)
    assert pool.allocator.used_bytes == 0


def test_pull_length_must_match_and_busy_keys_cannot_be_replaced() -> None:
    box, pool, _ = _outbox()
    box.add("k", pool.alloc(3305), is_fast_path=True)
    for bad in (3304, 3306, 4096):
        with pytest.raises(PullRefused, match="payload is 3305 bytes"):
            box.pin("k", bad)
    entry = box.pin("k", 3305)
    newer = pool.alloc(10)
    with pytest.raises(KeyBusyError):
        box.add("k", newer, is_fast_path=True)
    box.unpin(entry, consumed=False)
    box.add("k", newer, is_fast_path=True)  # idle: replaced, the old bytes are freed
    assert box.info("k") == (10, True) and pool.allocator.used_bytes == 4096


def test_a_released_zero_copy_buffer_is_held_until_pulled_or_expired() -> None:
    box, pool, clock = _outbox(ttl=10)
    own = pool.alloc(1000)  # the caller's buffer, published zero-copy, released right after the put
    box.add("k", own, is_fast_path=True, owns_buffer=False)
    own.release()
    assert own.released and own.held and pool.allocator.used_bytes == 4096
    with pytest.raises(RuntimeError, match="released"):
        own.tensor  # noqa: B018 - the caller's view ends at release
    other = pool.alloc(1000)
    assert other.offset != own.offset  # the next payload lands elsewhere
    entry = box.pin("k", 1000)
    box.unpin(entry, consumed=True)  # pulled: the hold ends and the bytes go back
    assert not own.held and pool.allocator.used_bytes == 4096
    # Not pulled: the TTL ends the hold.
    late = pool.alloc(1000)
    box.add("late", late, is_fast_path=True, owns_buffer=False)
    late.release()
    clock.now = 100
    assert box.sweep() == ["late"] and pool.allocator.used_bytes == 4096
    # Still owned by the caller when the entry goes: the caller's release frees it.
    kept = pool.alloc(1000)
    box.add("kept", kept, is_fast_path=True, owns_buffer=False)
    assert box.discard("kept") and not kept.held and pool.allocator.used_bytes == 8192
    kept.release()
    assert pool.allocator.used_bytes == 4096
    with pytest.raises(RuntimeError, match="cannot be published"):
        box.add("gone", kept, is_fast_path=True, owns_buffer=False)
    assert box.info("gone") is None
