"""Bounded, optionally authenticated control messages over ZMQ multipart frames.

A message is a msgspec Struct; on the wire it is ``[guard, kind, body piece, ...]``.
The msgpack body is cut into pieces of at most ``piece_bytes`` (32 KiB), so every
frame of every protocol stays small and a listener can refuse larger frames at
libzmq's frame header (``MAXMSGSIZE``, see :mod:`.zmq_setup`). Every Struct field
carries explicit bounds, and a Struct may add cross-field checks in a ``validate()``
method, so :meth:`ControlCodec.decode` rejects a malformed, oversized or
inconsistent message with :class:`ControlMessageError` before anything of it is used.

With a shared secret (the IO engine's ``auth_secret`` / ``MORI_IO_AUTH_SECRET``) a
last frame authenticates the message: a fresh 16-byte nonce, the send time (ms),
HMAC-SHA256(secret, guard | kind | recipient | nonce | time | body) and the
recipient in clear. The receiver checks the MAC, refuses messages older than
``max_age_s``, nonces it has already seen, and messages bound to another recipient:

* a request names the listener it is for (its address), so a message captured on
  the way to one listener is refused by every other one, in any process -- the
  seen-nonce set of one process cannot protect another;
* a reply names the request it answers (:meth:`ControlCodec.reply_binding`), so it
  is accepted only by the requester waiting for exactly that request.

A peer without the secret can thus neither forge nor replay a message, nor relay
one to another listener. The secret itself never crosses the wire.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import struct
import threading
import time
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Type, Union

import msgspec

__all__ = ["ControlCodec", "ControlMessageError", "PIECE_BYTES", "MAX_RECIPIENT_BYTES"]

PIECE_BYTES = 32 << 10  # body bytes per ZMQ frame
MAX_RECIPIENT_BYTES = 512
_NONCE_BYTES = 16
_STAMP_BYTES = 8
_MAC_BYTES = 32
_TAG_BYTES = _NONCE_BYTES + _STAMP_BYTES + _MAC_BYTES  # + the recipient
_REPLY_PREFIX = b"reply-to:"
_FRAME_SLACK = 1024  # guard, kind and tag frames, libzmq's CURVE framing


class ControlMessageError(ValueError):
    """A control message that is malformed, too large, inconsistent or not authentic."""


Recipient = Union[str, bytes]


def _as_bytes(recipient: Recipient) -> bytes:
    value = recipient.encode() if isinstance(recipient, str) else bytes(recipient)
    if len(value) > MAX_RECIPIENT_BYTES:
        raise ValueError(f"control message recipient of {len(value)} bytes exceeds {MAX_RECIPIENT_BYTES}")
    return value


class ControlCodec:
    """Encoder/decoder of one protocol's messages.

    Args:
        guard: first frame of every message of this protocol (tells it apart from others).
        kinds: ``{kind: (Struct type, max body bytes)}``.
        secret: shared secret; empty = messages are not authenticated (and authenticated
            ones are refused, since this side could not check them).
        max_age_s: oldest authenticated message accepted (clock skew between hosts included).
        piece_bytes: body bytes per frame.
    """

    def __init__(
        self,
        guard: bytes,
        kinds: Mapping[bytes, Tuple[Type[msgspec.Struct], int]],
        secret: bytes = b"",
        max_age_s: float = 120.0,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        if piece_bytes < 1024:
            raise ValueError(f"ControlCodec: piece_bytes must be >= 1024, got {piece_bytes}")
        self.guard = guard
        self._secret = bytes(secret)
        self._max_age_ms = int(max_age_s * 1000)
        self._piece = piece_bytes
        self._limits = {kind: limit for kind, (_, limit) in kinds.items()}
        self._kind_of: Dict[type, bytes] = {cls: kind for kind, (cls, _) in kinds.items()}
        self._decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, (cls, _) in kinds.items()}
        self._encoder = msgspec.msgpack.Encoder()
        self._seen: "collections.OrderedDict[bytes, int]" = collections.OrderedDict()
        self._seen_lock = threading.Lock()

    @property
    def authenticated(self) -> bool:
        return bool(self._secret)

    @property
    def secret(self) -> bytes:
        """The shared secret (for the sockets' connection-level authentication)."""
        return self._secret

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame this protocol sends: the bound for ZMQ ``MAXMSGSIZE``."""
        return self._piece + _FRAME_SLACK

    def is_ours(self, frames: List[bytes]) -> bool:
        return bool(frames) and frames[0] == self.guard

    # ----------------------------------------------------------- encode
    def encode(self, message: msgspec.Struct, recipient: Recipient = b"") -> List[bytes]:
        """Frames of one message (validated first, so we never send what a peer would reject).

        Args:
            recipient: with a secret, the listener (or, for a reply, the request: see
                :meth:`reply_binding`) the message is bound to; only a decoder given the
                same recipient accepts it. Ignored without a secret.
        """
        validate = getattr(message, "validate", None)
        if validate is not None:
            validate()
        kind = self._kind_of[type(message)]
        body = self._encoder.encode(message)
        if len(body) > self._limits[kind]:
            raise ControlMessageError(
                f"{kind!r} message of {len(body)} bytes exceeds the limit of {self._limits[kind]}"
            )
        pieces = [body[i : i + self._piece] for i in range(0, len(body), self._piece)] or [b""]
        if not self._secret:
            return [self.guard, kind, *pieces]
        to = _as_bytes(recipient)
        nonce = os.urandom(_NONCE_BYTES)
        stamp = struct.pack(">Q", int(time.time() * 1000))
        return [self.guard, kind, *pieces, nonce + stamp + self._mac(kind, to, nonce, stamp, pieces) + to]

    def reply_binding(self, request_frames: Sequence[bytes]) -> bytes:
        """The recipient a reply to the request ``request_frames`` is bound to (its nonce).

        b"" without a secret, or when the request carries no well-formed tag (a reply
        refusing such a request is then unbound).
        """
        if not self._secret or len(request_frames) < 4:
            return b""
        tag = bytes(request_frames[-1])
        if not _TAG_BYTES <= len(tag) <= _TAG_BYTES + MAX_RECIPIENT_BYTES:
            return b""
        return _REPLY_PREFIX + tag[:_NONCE_BYTES]

    # ----------------------------------------------------------- decode
    def decode(self, frames: List[bytes], recipient: Recipient = b"") -> Any:
        """Parse, authenticate and validate frames produced by :meth:`encode`.

        Args:
            recipient: with a secret, who this side is (this listener's address, or the
                :meth:`reply_binding` of the request whose reply is awaited); a message
                bound to anyone else is refused.

        Raises :class:`ControlMessageError` for anything wrong with the input, whatever
        the cause inside (invalid UTF-8, wrong types, failed checks): a listener that
        catches it survives every frame a peer can send.
        """
        try:
            return self._decode(frames, _as_bytes(recipient))
        except Exception as e:  # e.g. UnicodeDecodeError from msgspec, a validate() that tripped
            if not self._secret and self._looks_signed(frames):
                raise ControlMessageError(
                    "peer authenticates its control messages but this side has no shared secret"
                ) from None
            if isinstance(e, ControlMessageError):
                raise
            raise ControlMessageError(f"malformed control message ({type(e).__name__}: {str(e)[:200]})") from None

    def _decode(self, frames: List[bytes], recipient: bytes) -> Any:
        if len(frames) < 3 or frames[0] != self.guard:
            raise ControlMessageError(f"not a mori-suite control message ({len(frames)} frames)")
        if self._secret and len(frames) < 4:
            raise ControlMessageError(
                "unauthenticated control message refused (a shared secret is set here; set the same "
                "MORI_IO_AUTH_SECRET / auth_secret on both sides)"
            )
        kind = bytes(frames[1])
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise ControlMessageError(f"unknown message kind {kind[:32]!r}")
        pieces = frames[2:-1] if self._secret else frames[2:]
        limit = self._limits[kind]
        if len(pieces) > limit // self._piece + 1 or any(len(p) > self._piece for p in pieces):
            raise ControlMessageError(
                f"{kind!r} message in {len(pieces)} pieces (at most {limit // self._piece + 1} of {self._piece} bytes)"
            )
        size = sum(len(p) for p in pieces)
        if size > limit:
            raise ControlMessageError(f"{kind!r} message of {size} bytes exceeds the limit of {limit}")
        if self._secret:
            self._authenticate(kind, pieces, bytes(frames[-1]), recipient)
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        message = decoder.decode(body)
        validate = getattr(message, "validate", None)
        if validate is not None:
            validate()
        return message

    def _looks_signed(self, frames: List[bytes]) -> bool:
        """For the error message of a message that failed anyway: its last frame has a tag's shape."""
        return (len(frames) >= 4 and frames[0] == self.guard
                and _TAG_BYTES <= len(frames[-1]) <= _TAG_BYTES + MAX_RECIPIENT_BYTES)

    # ------------------------------------------------------------- auth
    def _mac(self, kind: bytes, recipient: bytes, nonce: bytes, stamp: bytes, pieces: Sequence[bytes]) -> bytes:
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (self.guard, kind, recipient, nonce, stamp):
            h.update(struct.pack(">I", len(part)))
            h.update(part)
        h.update(struct.pack(">Q", sum(len(p) for p in pieces)))
        for p in pieces:
            h.update(p)
        return h.digest()

    def _authenticate(self, kind: bytes, pieces: Sequence[bytes], tag: bytes, recipient: bytes) -> None:
        if not _TAG_BYTES <= len(tag) <= _TAG_BYTES + MAX_RECIPIENT_BYTES:
            raise ControlMessageError("control message authentication tag has the wrong size")
        nonce = tag[:_NONCE_BYTES]
        stamp = tag[_NONCE_BYTES : _NONCE_BYTES + _STAMP_BYTES]
        mac = tag[_NONCE_BYTES + _STAMP_BYTES : _TAG_BYTES]
        bound_to = tag[_TAG_BYTES:]
        if not hmac.compare_digest(mac, self._mac(kind, bound_to, nonce, stamp, pieces)):
            raise ControlMessageError("control message refused: bad authentication (different shared secret?)")
        if not hmac.compare_digest(bound_to, recipient):
            raise ControlMessageError(
                f"control message refused: addressed to {_show(bound_to)}, not to {_show(recipient)} "
                "(relayed or replayed from another recipient, or the sender dials this one by another address)"
            )
        now_ms = int(time.time() * 1000)
        sent_ms = struct.unpack(">Q", stamp)[0]
        if abs(now_ms - sent_ms) > self._max_age_ms:
            raise ControlMessageError(f"control message refused: sent {abs(now_ms - sent_ms)} ms from now (replay?)")
        with self._seen_lock:
            while self._seen and next(iter(self._seen.values())) < now_ms - 2 * self._max_age_ms:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise ControlMessageError("control message refused: replayed nonce")
            self._seen[nonce] = now_ms


def _show(recipient: bytes) -> str:
    """A recipient for an error message."""
    if not recipient:
        return "no one in particular"
    if recipient.startswith(_REPLY_PREFIX):
        return f"the request {recipient[len(_REPLY_PREFIX):].hex()[:12]}..."
    return repr(recipient.decode(errors="replace"))
