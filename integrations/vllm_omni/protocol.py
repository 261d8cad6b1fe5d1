"""Control-plane messages of the connector, carried by the shared codec
(:mod:`mori_integrations.common.control_codec`: bounded msgspec Structs in ZMQ
multipart frames, HMAC-signed, fresh and never replayed with a shared secret).

A receiver talks to a sender's listener with two requests:

* :class:`QueryRequest`  -> :class:`QueryResponse` (size + kind of a ready
  payload) or :class:`NotFound`;
* :class:`PullRequest`   -> :class:`PullResponse` once the sender's IO engine
  finished writing the payload into the receiver's pool (or failed to).

Every message carries ``seq`` so a reply can be matched to its request on a
socket that also saw replies to requests its caller gave up on. The codec
enforces every size limit (msgspec ``Meta`` constraints) and turns any decoding
problem into :class:`ProtocolError`, so a message that decodes is safe to use.

With a secret (``auth_secret`` / ``MORI_IO_AUTH_SECRET``) a peer without it can
neither connect (CURVE), query, pull (take a payload, or make the sender write
into some other engine's memory), nor answer in the sender's name. A request is
bound to the sender it is addressed to (its listener address), so a pull
captured on its way to one sender is refused by every other one, even when
several senders hold a payload under the same key; a reply is bound to the
request it answers. Without a secret, anyone who reaches the port can do all of
that: the connector warns at start when it listens beyond loopback so.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from mori_integrations.common.control_codec import ControlCodec, ControlMessageError

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_KEY_CHARS",
    "MAX_DESC_BYTES",
    "MAX_PAYLOAD_BYTES",
    "ProtocolError",
    "QueryRequest",
    "PullRequest",
    "QueryResponse",
    "PullResponse",
    "NotFound",
    "Rejected",
    "Request",
    "Reply",
    "GUARD",
    "make_codec",
]

MAX_FRAME_BYTES = 64 * 1024  # a message body: a key + two packed descriptors at most (sent in 32 KiB frames)
MAX_KEY_CHARS = 1024
MAX_DESC_BYTES = 16 * 1024  # packed EngineDesc / MemoryDesc are a few hundred bytes
MAX_PAYLOAD_BYTES = 1 << 40  # the largest pool the settings accept
MAX_ERROR_CHARS = 1024

Seq = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_CHARS)]
PackedDesc = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_DESC_BYTES)]
Offset = Annotated[int, msgspec.Meta(ge=0, lt=MAX_PAYLOAD_BYTES)]
Length = Annotated[int, msgspec.Meta(ge=1, le=MAX_PAYLOAD_BYTES)]
ErrorText = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)]


# A control message that is too large, not msgpack, violates a limit or is not authentic.
ProtocolError = ControlMessageError


class QueryRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender: is payload ``key`` ready, and how large is it?"""

    seq: Seq
    key: Key


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender: write payload ``key`` (exactly ``length`` bytes) into
    the receiver's pool region ``mem_desc`` at ``dst_offset``."""

    seq: Seq
    key: Key
    engine_desc: PackedDesc  # the receiver's packed EngineDesc
    mem_desc: PackedDesc  # the receiver's packed pool MemoryDesc
    dst_offset: Offset
    length: Length


class QueryResponse(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sender -> receiver: payload ``key`` is ready."""

    seq: Seq
    key: Key
    data_size: Length
    is_fast_path: bool


class PullResponse(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sender -> receiver: the write finished (``ok``) or failed (``error``).

    ``write_pending`` is True only if the sender's write did not end within its
    bound; the receiver must then never reuse the destination bytes.
    """

    seq: Seq
    key: Key
    ok: bool
    error: ErrorText = ""
    write_pending: bool = False


class NotFound(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sender -> receiver: no payload under ``key`` (not yet put, or consumed)."""

    seq: Seq
    key: Key


class Rejected(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sender -> receiver: the request could not be decoded or was refused."""

    seq: Seq
    reason: ErrorText


Request = Union[QueryRequest, PullRequest]
Reply = Union[QueryResponse, PullResponse, NotFound, Rejected]

GUARD = b"MoriSuiteOmni1"
_KINDS = {
    b"QUERY": (QueryRequest, MAX_FRAME_BYTES),
    b"PULL": (PullRequest, MAX_FRAME_BYTES),
    b"INFO": (QueryResponse, MAX_FRAME_BYTES),
    b"DONE": (PullResponse, MAX_FRAME_BYTES),
    b"NOTFOUND": (NotFound, MAX_FRAME_BYTES),
    b"REJECT": (Rejected, MAX_FRAME_BYTES),
}
REQUESTS = (QueryRequest, PullRequest)
REPLIES = (QueryResponse, PullResponse, NotFound, Rejected)


def make_codec(secret: str = "") -> ControlCodec:
    """The connector's codec; with a secret every message is signed, fresh and checked against replays."""
    return ControlCodec(GUARD, _KINDS, secret.encode())
