"""Control-plane messages of the connector (msgpack via msgspec, validated on decode).

A receiver talks to a sender's listener with two requests:

* :class:`QueryRequest`  -> :class:`QueryResponse` (size + kind of a ready
  payload) or :class:`NotFound`;
* :class:`PullRequest`   -> :class:`PullResponse` once the sender's IO engine
  finished writing the payload into the receiver's pool (or failed to).

Every message carries ``seq`` so a reply can be matched to its request on a
socket that also saw replies to requests its caller gave up on. The decoder
enforces every size limit (msgspec ``Meta`` constraints), so a frame that
decodes is safe to use; anything else raises :class:`ProtocolError`.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

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
    "encode",
    "decode_request",
    "decode_reply",
]

MAX_FRAME_BYTES = 64 * 1024  # a request is a key + two packed descriptors
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


class ProtocolError(ValueError):
    """A control frame that is too large, not msgpack, or violates a limit."""


class QueryRequest(msgspec.Struct, tag="query", frozen=True):
    """Receiver -> sender: is payload ``key`` ready, and how large is it?"""

    seq: Seq
    key: Key


class PullRequest(msgspec.Struct, tag="pull", frozen=True):
    """Receiver -> sender: write payload ``key`` (exactly ``length`` bytes) into
    the receiver's pool region ``mem_desc`` at ``dst_offset``."""

    seq: Seq
    key: Key
    engine_desc: PackedDesc  # the receiver's packed EngineDesc
    mem_desc: PackedDesc  # the receiver's packed pool MemoryDesc
    dst_offset: Offset
    length: Length


class QueryResponse(msgspec.Struct, tag="info", frozen=True):
    """Sender -> receiver: payload ``key`` is ready."""

    seq: Seq
    key: Key
    data_size: Length
    is_fast_path: bool


class PullResponse(msgspec.Struct, tag="done", frozen=True):
    """Sender -> receiver: the write finished (``ok``) or failed (``error``).

    ``write_pending`` is True only if the sender's write did not end within its
    bound; the receiver must then never reuse the destination bytes.
    """

    seq: Seq
    key: Key
    ok: bool
    error: ErrorText = ""
    write_pending: bool = False


class NotFound(msgspec.Struct, tag="not_found", frozen=True):
    """Sender -> receiver: no payload under ``key`` (not yet put, or consumed)."""

    seq: Seq
    key: Key


class Rejected(msgspec.Struct, tag="rejected", frozen=True):
    """Sender -> receiver: the request could not be decoded or was refused."""

    seq: Seq
    reason: ErrorText


Request = Union[QueryRequest, PullRequest]
Reply = Union[QueryResponse, PullResponse, NotFound, Rejected]

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
_REPLY_DECODER = msgspec.msgpack.Decoder(Reply)


def encode(message: msgspec.Struct) -> bytes:
    """msgpack bytes of one message."""
    return _ENCODER.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes, what: str):
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{what} frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ProtocolError(f"malformed {what}: {exc}") from None


def decode_request(frame: bytes) -> Request:
    """Decode and validate one request frame; raises :class:`ProtocolError`."""
    return _decode(_REQUEST_DECODER, frame, "request")


def decode_reply(frame: bytes) -> Reply:
    """Decode and validate one reply frame; raises :class:`ProtocolError`."""
    return _decode(_REPLY_DECODER, frame, "reply")
