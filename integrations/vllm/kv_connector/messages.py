"""Control messages of the connector (ZMQ, bounded msgspec Structs; see ``common.control_codec``).

Per worker two sockets (MoRIIO's port scheme): a ROUTER on ``handshake_port + offset``
answers :class:`GetMeta` with :class:`AgentMetadata`; a PULL on ``notify_port + offset``
receives the notifications below. Producer = prefill worker, consumer = decode worker.

* consumer -> producer :class:`WriteRequest`  (WRITE mode: where to write one request's KV)
* consumer -> producer :class:`ConsumerDone`  (READ finished, request aborted, or nothing needed:
  the producer may free the request's blocks once every consumer rank said so)
* producer -> consumer :class:`WriteDone`     (WRITE mode: every write into this consumer ended)

A consumer addresses its notifications to the producer *process* it handshook with
(``producer_key``, that worker's IO engine key): a server restarted on the same ports is
another process that never held the request's KV, so it refuses a write request meant for
its predecessor and ignores a :class:`ConsumerDone` meant for it.
"""

from __future__ import annotations

import collections
import threading
from typing import Annotated, List, Tuple

import msgspec

from mori_integrations.common.control_codec import ControlCodec, ControlMessageError

__all__ = [
    "AgentMetadata",
    "ConsumerDone",
    "ControlMessageError",
    "GetMeta",
    "LayerLayout",
    "WriteDone",
    "WriteRequest",
    "encoded_metadata",
    "make_codec",
]

GUARD = b"MoriSuiteVllmKV1"
MAX_LAYERS = 4096
MAX_RUNS = 1 << 16  # byte runs of one block / head
MAX_REGIONS = 4096
MAX_GROUPS = 64
MAX_BLOCKS = 1 << 22  # blocks of one request in one group
MAX_NAME = 512
MAX_DESC = 4096
MAX_TP = 1024

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
Positive = Annotated[int, msgspec.Meta(ge=1, le=(1 << 62))]
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_TP - 1)]
Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
Desc = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_DESC)]
Run = Tuple[NonNeg, Positive]
Runs = Annotated[List[Run], msgspec.Meta(min_length=1, max_length=MAX_RUNS)]
BlockIds = Annotated[List[NonNeg], msgspec.Meta(max_length=MAX_BLOCKS)]
TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=4096)]
EngineKey = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]  # "" = any (an older peer)


class LayerLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one layer's KV blocks live inside a registered region.

    Manager block ``b``, head ``h`` starts at ``offset + b * block_stride + h * head_stride``;
    ``head_runs`` are that head's bytes (relative, in logical order), ``block_runs`` all
    heads of the block (head-major). ``content`` must match between paired layers
    (dtype, tokens per kernel block, bytes per token and head).
    """

    name: Name
    group: Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]
    region: Annotated[int, msgspec.Meta(ge=0, lt=MAX_REGIONS)]
    offset: NonNeg
    block_stride: Positive
    head_stride: NonNeg
    num_heads: Size
    head_runs: Runs
    block_runs: Runs
    content: Name

    @property
    def head_bytes(self) -> int:
        return sum(n for _, n in self.head_runs)

    @property
    def block_bytes(self) -> int:
        return sum(n for _, n in self.block_runs)


class GetMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Ask a worker for its :class:`AgentMetadata`."""

    requester: Name


class AgentMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a peer needs to move KV to or from one worker."""

    engine_id: Name  # vLLM's kv_transfer_config.engine_id of the server
    engine_desc: Desc  # packed mori_core.io EngineDesc
    regions: Annotated[List[Desc], msgspec.Meta(min_length=1, max_length=MAX_REGIONS)]  # packed MemoryDescs
    layers: Annotated[List[LayerLayout], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]
    tp_rank: Rank
    tp_size: Size
    dp_rank: Rank
    total_kv_heads: Size
    replicated_heads: bool  # MLA: every rank holds the whole cache
    block_size: Positive  # tokens per manager block (of group 0)
    group_block_sizes: Annotated[List[Positive], msgspec.Meta(min_length=1, max_length=MAX_GROUPS)]
    notify_host: Name
    notify_port: Port
    # The server process (its scheduler's nonce, ``remote_instance_id``); "" until the worker ran a step.
    instance: EngineKey = ""
    # Its same-host doorbell board (common.doorbell; "" = none): a producer on this host rings it
    # when its writes completed, ahead of the WriteDone message.
    doorbell: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # Its same-host inbox (common.local_inbox; "" = none): a consumer on this host sends it its
    # write requests there, one thread wake-up instead of ZMQ's three.
    inbox: Annotated[str, msgspec.Meta(max_length=64)] = ""

    def validate(self) -> None:
        for layer in self.layers:
            if layer.region >= len(self.regions):
                raise ControlMessageError(f"layer {layer.name} names region {layer.region} of {len(self.regions)}")
            if layer.group >= len(self.group_block_sizes):
                raise ControlMessageError(f"layer {layer.name} names KV cache group {layer.group}")
        if self.tp_rank >= self.tp_size:
            raise ControlMessageError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")


class WriteRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Consumer rank -> every producer rank: write request ``transfer_id`` into these blocks.

    ``consumer`` is the consumer's :class:`AgentMetadata`, msgpack-encoded in place (a
    ``msgspec.Raw``: the bytes on the wire are those of the nested struct). A consumer sends
    the same metadata with every request, so each side handles it once per peer process:
    the consumer encodes it once (:func:`encoded_metadata`), the producer decodes and
    validates each distinct encoding once (:attr:`consumer_meta`, cached). Decoding 32
    layers' metadata cost ~100 us per request, more than the rest of the message.
    ``positions[g]`` is the index (in the request's block list of group ``g``) of
    ``block_ids[g][0]``: blocks before it are the consumer's own prefix-cache hits.
    The producer may start writes until ``budget_ms`` after it received this message.
    ``producer_key``: the producer engine the consumer handshook with (another one refuses).
    ``doorbell_slot`` / ``doorbell_seq``: where on the consumer's doorbell board a producer on
    the same host signals success (-1: nowhere); the WriteDone message follows regardless.
    """

    transfer_id: TransferId
    consumer: msgspec.Raw
    block_ids: Annotated[List[BlockIds], msgspec.Meta(max_length=MAX_GROUPS)]
    positions: Annotated[List[NonNeg], msgspec.Meta(max_length=MAX_GROUPS)]
    budget_ms: Annotated[int, msgspec.Meta(ge=0, le=86_400_000)]
    producer_key: EngineKey = ""
    doorbell_slot: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31))] = -1
    doorbell_seq: NonNeg = 0

    @property
    def consumer_meta(self) -> AgentMetadata:
        """The consumer's metadata, decoded and validated (ControlMessageError when invalid)."""
        return _decoded_metadata(self.consumer)

    def validate(self) -> None:
        self.consumer_meta  # noqa: B018  (decodes and validates the nested metadata)
        if len(self.block_ids) != len(self.positions):
            raise ControlMessageError("write request: block_ids and positions differ in group count")


_META_DECODER = msgspec.msgpack.Decoder(AgentMetadata)
_META_CACHE: "collections.OrderedDict[bytes, AgentMetadata]" = collections.OrderedDict()
_META_CACHE_SIZE = 256  # distinct consumer processes remembered (an evicted one is decoded again)
_META_LOCK = threading.Lock()


def encoded_metadata(meta: AgentMetadata) -> msgspec.Raw:
    """``meta`` encoded once, for :class:`WriteRequest`'s ``consumer``."""
    return msgspec.Raw(msgspec.msgpack.encode(meta))


def _decoded_metadata(raw: msgspec.Raw) -> AgentMetadata:
    key = bytes(raw)
    with _META_LOCK:
        meta = _META_CACHE.get(key)
        if meta is not None:
            _META_CACHE.move_to_end(key)
            return meta
    try:
        meta = _META_DECODER.decode(key)
    except msgspec.DecodeError as e:  # ValidationError included: a bound of AgentMetadata was broken
        raise ControlMessageError(f"write request: consumer metadata: {e}") from None
    meta.validate()
    with _META_LOCK:
        _META_CACHE[key] = meta
        while len(_META_CACHE) > _META_CACHE_SIZE:
            _META_CACHE.popitem(last=False)
    return meta


class ConsumerDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Consumer rank -> every producer rank: it needs nothing more of ``transfer_id``."""

    transfer_id: TransferId
    consumer_key: Name
    consumer_rank: Rank
    consumer_tp: Size
    ok: bool
    nbytes: NonNeg
    reason: Reason = ""
    producer_key: EngineKey = ""  # the producer engine this is meant for (another one ignores it)


class WriteDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Producer rank -> consumer rank: every write of ``transfer_id`` into it has ended."""

    transfer_id: TransferId
    producer_rank: Rank
    producer_tp: Size
    ok: bool
    nbytes: NonNeg
    elapsed_us: NonNeg  # first write submitted -> last write completed
    reason: Reason = ""
    producer_key: EngineKey = ""  # the replying producer's engine (differs from the asked one: it restarted)


_KINDS = {
    b"GET": (GetMeta, 4 << 10),
    b"META": (AgentMetadata, 16 << 20),
    b"WREQ": (WriteRequest, 64 << 20),
    b"CDONE": (ConsumerDone, 16 << 10),
    b"WDONE": (WriteDone, 16 << 10),
}


def make_codec(secret: str) -> ControlCodec:
    """The connector's codec; with a secret every message is authenticated (HMAC)."""
    return ControlCodec(GUARD, _KINDS, secret.encode())
