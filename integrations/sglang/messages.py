"""Control messages between prefill and decode managers (over SGLang's ZMQ sockets).

Every message of ours is ``[WIRE_GUARD, kind, msgpack body in 32 KiB frames...]``; the
body is a msgspec Struct whose fields carry explicit bounds, so a malformed or
oversized message is rejected by :func:`decode_message` with a
:class:`ControlMessageError` (callers log it and drop the message; nothing of it
is used). The guard differs from SGLang's in-tree mori backend (``MoriMsgGuard``):
a peer running that backend is recognised and reported, never misparsed.

SGLang's own ``ABORT`` / ``ABORT_ACK`` frames (sent by ``CommonKVReceiver`` /
``CommonKVManager``) keep their format; :func:`check_frames` bounds them before
SGLang's parsers see them.
"""

from __future__ import annotations

from typing import Annotated, List, Optional, Union

import msgspec
import numpy as np
import numpy.typing as npt

from mori_integrations.common.control_codec import ControlCodec, ControlMessageError  # noqa: F401  (re-exported)

WIRE_GUARD = b"MoriSuiteKV1"
STOCK_MORI_GUARD = b"MoriMsgGuard"  # SGLang's in-tree backend; never spoken here

KIND_REGISTER = b"REG"
KIND_METADATA = b"META"
KIND_STATUS = b"STATUS"

# Bounds. Generous for real deployments (e.g. 1M-token requests at page size 1,
# 512-layer hybrid pools), small enough that a bad peer cannot make us allocate
# unbounded memory.
MAX_KV_ENTRIES = 8192  # per-layer K/V (+ draft) regions of one rank
MAX_STATE_COMPONENTS = 64
MAX_STATE_ENTRIES = 8192  # regions of one state component
MAX_AUX_BUFFERS = 256
MAX_PAGES = 1 << 22  # pages of one request
MAX_STATE_INDICES = 1 << 22  # state slots/pages of one component of one request
MAX_DESC_BYTES = 4096  # one packed EngineDesc / MemoryDesc
MAX_NAME = 512  # host names, engine keys
MAX_REASON = 4096  # failure reason text
MAX_BODY_BYTES = {
    KIND_REGISTER: 16 << 20,
    KIND_METADATA: 64 << 20,
    KIND_STATUS: 16 << 10,
}
MAX_SGLANG_FRAMES = 8  # ABORT / ABORT_ACK / BOOTSTRAP frames of SGLang's Common code
MAX_SGLANG_FRAME_BYTES = 256

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
Room = NonNeg  # SGLang draws bootstrap rooms from [0, 2**63)
DescBlob = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_DESC_BYTES)]
IntList = Annotated[List[NonNeg], msgspec.Meta(max_length=MAX_STATE_ENTRIES)]


class PeerRegistration(msgspec.Struct, forbid_unknown_fields=True):
    """Decode rank -> each target prefill rank, once per (decode rank, prefill rank).

    Describes where the decode rank's memory is and how it is laid out, so the
    prefill can plan writes into it.
    """

    endpoint: Name  # decode control (ZMQ PULL) host
    rank_port: Port  # decode control port
    engine_desc: DescBlob  # packed mori_core.io EngineDesc
    kv_descs: Annotated[List[DescBlob], msgspec.Meta(max_length=MAX_KV_ENTRIES)]
    kv_item_lens: Annotated[List[Positive], msgspec.Meta(max_length=MAX_KV_ENTRIES)]
    kv_layer_ids: Annotated[List[NonNeg], msgspec.Meta(max_length=MAX_KV_ENTRIES)]
    aux_descs: Annotated[List[DescBlob], msgspec.Meta(max_length=MAX_AUX_BUFFERS)]
    aux_item_lens: Annotated[List[Positive], msgspec.Meta(max_length=MAX_AUX_BUFFERS)]
    state_types: Annotated[List[Name], msgspec.Meta(max_length=MAX_STATE_COMPONENTS)]
    # None keeps a zero-length (elided) region's slot so entries stay index-aligned.
    state_descs: Annotated[
        List[Annotated[List[Optional[DescBlob]], msgspec.Meta(max_length=MAX_STATE_ENTRIES)]],
        msgspec.Meta(max_length=MAX_STATE_COMPONENTS),
    ]
    state_item_lens: Annotated[List[IntList], msgspec.Meta(max_length=MAX_STATE_COMPONENTS)]
    state_dim_per_tensor: Annotated[List[IntList], msgspec.Meta(max_length=MAX_STATE_COMPONENTS)]
    state_layer_ids: Annotated[List[IntList], msgspec.Meta(max_length=MAX_STATE_COMPONENTS)]
    gpu_id: Annotated[int, msgspec.Meta(ge=-1, le=1 << 16)]
    attn_tp_size: Positive
    attn_tp_rank: NonNeg  # kv_args.engine_rank
    page_size: Positive
    is_mla: bool
    dcp_size: Positive
    dcp_rank: NonNeg
    kv_cache_dtype: Annotated[str, msgspec.Meta(max_length=64)]

    def validate(self) -> None:
        """Cross-field checks msgspec's per-field bounds cannot express."""
        if len(self.kv_descs) != len(self.kv_item_lens):
            raise ControlMessageError(
                f"registration: {len(self.kv_descs)} KV regions but {len(self.kv_item_lens)} item lengths"
            )
        if self.kv_layer_ids and len(self.kv_layer_ids) != len(self.kv_descs):
            raise ControlMessageError("registration: kv_layer_ids does not match the KV regions")
        if len(self.aux_descs) != len(self.aux_item_lens):
            raise ControlMessageError("registration: aux regions and item lengths differ in count")
        n = len(self.state_types)
        for name, lists in (
            ("state_descs", self.state_descs),
            ("state_item_lens", self.state_item_lens),
        ):
            if len(lists) != n:
                raise ControlMessageError(f"registration: {name} has {len(lists)} components, expected {n}")
        for i, (descs, lens) in enumerate(zip(self.state_descs, self.state_item_lens)):
            if len(descs) != len(lens):
                raise ControlMessageError(f"registration: state component {i} has mismatched regions/lengths")
        if self.attn_tp_rank >= self.attn_tp_size:
            raise ControlMessageError(
                f"registration: attn_tp_rank {self.attn_tp_rank} out of range for size {self.attn_tp_size}"
            )
        if self.dcp_rank >= self.dcp_size:
            raise ControlMessageError("registration: dcp_rank out of range")


class TransferMetadata(msgspec.Struct, forbid_unknown_fields=True):
    """Decode rank -> prefill rank, once per request: where to write this request."""

    room: Room
    endpoint: Name
    rank_port: Port
    engine_key: Name
    # int32 little-endian destination page indices (empty for a dummy rank).
    kv_pages: Annotated[bytes, msgspec.Meta(max_length=4 * MAX_PAGES)]
    aux_index: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31) - 1)]  # -1: no aux row
    state_indices: Annotated[
        List[Annotated[List[NonNeg], msgspec.Meta(max_length=MAX_STATE_INDICES)]],
        msgspec.Meta(max_length=MAX_STATE_COMPONENTS),
    ]
    required_dst_info_num: Positive
    decode_prefix_len: NonNeg
    is_dummy: bool

    def validate(self) -> None:
        if len(self.kv_pages) % 4:
            raise ControlMessageError("metadata: kv_pages is not a whole number of int32")
        pages = self.page_indices()
        if pages.size and int(pages.min()) < 0:
            raise ControlMessageError("metadata: negative page index")

    def page_indices(self) -> npt.NDArray[np.int32]:
        """The destination page indices as an int32 array (a view of the message)."""
        return np.frombuffer(self.kv_pages, dtype="<i4")


class KVStatus(msgspec.Struct, forbid_unknown_fields=True):
    """Prefill rank -> decode rank: terminal or bootstrap status of a room."""

    room: Room
    status: Annotated[int, msgspec.Meta(ge=0, le=4)]  # KVPoll value
    prefill_rank: NonNeg
    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON)] = ""


Message = Union[PeerRegistration, TransferMetadata, KVStatus]

_CODEC = ControlCodec(
    WIRE_GUARD,
    {
        KIND_REGISTER: (PeerRegistration, MAX_BODY_BYTES[KIND_REGISTER]),
        KIND_METADATA: (TransferMetadata, MAX_BODY_BYTES[KIND_METADATA]),
        KIND_STATUS: (KVStatus, MAX_BODY_BYTES[KIND_STATUS]),
    },
)


# ZMQ MAXMSGSIZE of the managers' PULL sockets: bodies travel in frames of at most
# 32 KiB, so one frame above this drops the sender's connection at the frame header,
# before anything of it is buffered (SGLang's own control frames are a few bytes).
MAX_FRAME_BYTES = _CODEC.max_frame_bytes


def encode_message(message: Message) -> List[bytes]:
    """Frames of one control message (validated first, so we never send what we would reject)."""
    return _CODEC.encode(message)


def is_ours(frames: List[bytes]) -> bool:
    return _CODEC.is_ours(frames)


def decode_message(frames: List[bytes]) -> Message:
    """Parse and validate frames produced by :func:`encode_message`.

    Raises:
        ControlMessageError: wrong guard, unknown kind, oversized, malformed or
            inconsistent body.
    """
    return _CODEC.decode(frames)


def check_frames(frames: List[bytes]) -> None:
    """Bound an SGLang Common control message (ABORT, ABORT_ACK, BOOTSTRAP) before parsing it."""
    if not frames or len(frames) > MAX_SGLANG_FRAMES:
        raise ControlMessageError(f"SGLang control message with {len(frames)} frames")
    for f in frames:
        if len(f) > MAX_SGLANG_FRAME_BYTES:
            raise ControlMessageError(f"SGLang control frame of {len(f)} bytes")


def truncate_reason(reason: Optional[str]) -> str:
    """A failure reason that fits :class:`KVStatus`."""
    text = reason or ""
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."
