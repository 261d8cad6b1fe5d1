"""Bounded, optionally authenticated control messages over ZMQ multipart frames.

A message is a msgspec Struct; on the wire it is ``[guard, kind, msgpack body]``.
Every Struct field carries explicit bounds, and a Struct may add cross-field
checks in a ``validate()`` method, so :meth:`ControlCodec.decode` rejects a
malformed, oversized or inconsistent message with :class:`ControlMessageError`
before anything of it is used.

With a shared secret (the IO engine's ``auth_secret`` / ``MORI_IO_AUTH_SECRET``)
a fourth frame authenticates the message: a fresh 16-byte nonce, the send time
(ms) and HMAC-SHA256(secret, guard | kind | nonce | time | body). The receiver
checks the MAC, refuses messages older than ``max_age_s`` and nonces it has
already seen, so a peer without the secret can neither forge nor replay one.
The secret itself never crosses the wire.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import struct
import threading
import time
from typing import Any, Dict, List, Mapping, Tuple, Type

import msgspec

__all__ = ["ControlCodec", "ControlMessageError"]

_NONCE_BYTES = 16
_TAG_BYTES = _NONCE_BYTES + 8 + 32


class ControlMessageError(ValueError):
    """A control message that is malformed, too large, inconsistent or not authentic."""


class ControlCodec:
    """Encoder/decoder of one protocol's messages.

    Args:
        guard: first frame of every message of this protocol (tells it apart from others).
        kinds: ``{kind: (Struct type, max body bytes)}``.
        secret: shared secret; empty = messages are not authenticated (and authenticated
            ones are refused, since this side could not check them).
        max_age_s: oldest authenticated message accepted (clock skew between hosts included).
    """

    def __init__(
        self,
        guard: bytes,
        kinds: Mapping[bytes, Tuple[Type[msgspec.Struct], int]],
        secret: bytes = b"",
        max_age_s: float = 120.0,
    ) -> None:
        self.guard = guard
        self._secret = bytes(secret)
        self._max_age_ms = int(max_age_s * 1000)
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
    def max_frame_bytes(self) -> int:
        """A bound for ZMQ ``MAXMSGSIZE`` on sockets that receive this protocol."""
        return max(self._limits.values()) + 4096

    def is_ours(self, frames: List[bytes]) -> bool:
        return bool(frames) and frames[0] == self.guard

    def encode(self, message: msgspec.Struct) -> List[bytes]:
        """Frames of one message (validated first, so we never send what a peer would reject)."""
        validate = getattr(message, "validate", None)
        if validate is not None:
            validate()
        kind = self._kind_of[type(message)]
        body = self._encoder.encode(message)
        if len(body) > self._limits[kind]:
            raise ControlMessageError(
                f"{kind!r} message of {len(body)} bytes exceeds the limit of {self._limits[kind]}"
            )
        if not self._secret:
            return [self.guard, kind, body]
        nonce = os.urandom(_NONCE_BYTES)
        stamp = struct.pack(">Q", int(time.time() * 1000))
        return [self.guard, kind, body, nonce + stamp + self._mac(kind, nonce, stamp, body)]

    def decode(self, frames: List[bytes]) -> Any:
        """Parse, authenticate and validate frames produced by :meth:`encode`.

        Raises :class:`ControlMessageError` for anything wrong with the input, whatever
        the cause inside (invalid UTF-8, wrong types, failed checks): a listener that
        catches it survives every frame a peer can send.
        """
        try:
            return self._decode(frames)
        except ControlMessageError:
            raise
        except Exception as e:  # e.g. UnicodeDecodeError from msgspec, a validate() that tripped
            raise ControlMessageError(f"malformed control message ({type(e).__name__}: {str(e)[:200]})") from None

    def _decode(self, frames: List[bytes]) -> Any:
        expected = 4 if self._secret else 3
        if len(frames) not in (3, 4) or frames[0] != self.guard:
            raise ControlMessageError(f"not a mori-suite control message ({len(frames)} frames)")
        if len(frames) != expected:
            raise ControlMessageError(
                "peer authenticates its control messages but this side has no shared secret"
                if len(frames) == 4
                else "unauthenticated control message refused (a shared secret is set here; set the same "
                "MORI_IO_AUTH_SECRET / auth_secret on both sides)"
            )
        kind, body = bytes(frames[1]), frames[2]
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise ControlMessageError(f"unknown message kind {kind[:32]!r}")
        if len(body) > self._limits[kind]:
            raise ControlMessageError(
                f"{kind!r} message of {len(body)} bytes exceeds the limit of {self._limits[kind]}"
            )
        if self._secret:
            self._authenticate(kind, body, frames[3])
        message = decoder.decode(body)
        validate = getattr(message, "validate", None)
        if validate is not None:
            validate()
        return message

    # ------------------------------------------------------------- auth
    def _mac(self, kind: bytes, nonce: bytes, stamp: bytes, body: bytes) -> bytes:
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (self.guard, kind, nonce, stamp, body):
            h.update(struct.pack(">I", len(part)))
            h.update(part)
        return h.digest()

    def _authenticate(self, kind: bytes, body: bytes, tag: bytes) -> None:
        if len(tag) != _TAG_BYTES:
            raise ControlMessageError("control message authentication tag has the wrong size")
        nonce, stamp, mac = tag[:_NONCE_BYTES], tag[_NONCE_BYTES : _NONCE_BYTES + 8], tag[_NONCE_BYTES + 8 :]
        if not hmac.compare_digest(mac, self._mac(kind, nonce, stamp, body)):
            raise ControlMessageError("control message refused: bad authentication (different shared secret?)")
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
