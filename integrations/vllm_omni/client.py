"""The receiver's side of the control plane: requests with deadlines over ZMQ DEALER sockets.

Sockets are cached per thread and per sender endpoint (a ZMQ socket must stay
on one thread); with a secret they authenticate with CURVE
(:mod:`~mori_integrations.common.zmq_setup`). A request is bound to the sender
it is sent to (its canonical address), so no other sender accepts it; its reply
is bound to the request and is accepted only as the answer to it. Replies are
matched by ``seq``; a stale reply (to a request whose caller gave up) is
skipped. A socket whose pull is still unanswered is *detached* from the cache
and handed to the caller, so the late reply — which says when the sender
stopped writing into our pool — is not lost.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Optional, Tuple

import zmq

from mori_integrations.common.control_codec import ControlCodec
from mori_integrations.common.log_limit import RateLimitedLog
from mori_integrations.common.net import canonical_tcp_address
from mori_integrations.common.zmq_setup import secure_client

from . import protocol
from .protocol import Reply

__all__ = ["PullClient", "wait_reply"]

logger = logging.getLogger(__name__)
_bad_replies = RateLimitedLog(logger, what="undecodable replies")


def wait_reply(codec: ControlCodec, sock: zmq.Socket, seq: int, deadline: float,
               binding: bytes = b"") -> Optional[Reply]:
    """The reply with ``seq`` on ``sock``, or None once ``deadline`` (monotonic) passed.

    ``binding``: the :meth:`ControlCodec.reply_binding` of the request (with a secret,
    a reply bound to anything else is refused). Undecodable or unauthentic messages
    and replies to other requests are skipped (logged, rate-limited).
    """
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 and not sock.poll(0):
            return None
        if not sock.poll(max(remaining_ms, 0)):
            continue
        frames = sock.recv_multipart(zmq.NOBLOCK)
        try:
            reply = codec.decode(frames, recipient=binding)
            if not isinstance(reply, protocol.REPLIES):
                raise protocol.ProtocolError(f"{type(reply).__name__} is not a reply")
        except protocol.ProtocolError as exc:
            _bad_replies.warning(str(sock.getsockopt(zmq.LAST_ENDPOINT), "utf-8", "replace"),
                                 "ignoring an undecodable control reply: %s", exc)
            continue
        if reply.seq == seq or (reply.seq == 0 and isinstance(reply, protocol.Rejected)):
            return reply
        logger.debug("skipping a stale reply (seq %d, waiting for %d)", reply.seq, seq)


class PullClient:
    """Request/reply with bounded waits towards many sender endpoints."""

    def __init__(self, ctx: zmq.Context, codec: ControlCodec) -> None:
        self._ctx = ctx
        self.codec = codec
        self._local = threading.local()
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()

    def next_seq(self) -> int:
        """A fresh request id (unique within this client)."""
        with self._seq_lock:
            return next(self._seq)

    def _cache(self) -> dict[str, zmq.Socket]:
        cache = getattr(self._local, "sockets", None)
        if cache is None:
            cache = self._local.sockets = {}
        return cache

    def socket(self, address: str) -> zmq.Socket:
        """This thread's DEALER socket connected to ``address``."""
        cache = self._cache()
        sock = cache.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self.codec.secret, self.codec.max_frame_bytes)
            sock.connect(address)
            cache[address] = sock
        return sock

    def detach(self, address: str) -> Optional[zmq.Socket]:
        """Remove this thread's socket for ``address`` from the cache and return it."""
        return self._cache().pop(address, None)

    def drop(self, address: str) -> None:
        """Close this thread's socket for ``address`` (its pending replies die with it)."""
        sock = self.detach(address)
        if sock is not None:
            sock.close(linger=0)

    def send(self, address: str, message: object) -> Tuple[zmq.Socket, bytes]:
        """Queue ``message`` (bound to the sender at ``address``) towards ``address``.

        Returns the socket the reply will arrive on and the binding the reply must carry.
        """
        sock = self.socket(address)
        frames = self.codec.encode(message, recipient=canonical_tcp_address(address))
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full: treat like a lost peer
            self.drop(address)
            raise TimeoutError(f"control queue towards {address} is full") from None
        return sock, self.codec.reply_binding(frames)

    def request(self, address: str, message: object, deadline: float) -> Optional[Reply]:
        """Send ``message`` and wait for its reply until ``deadline``; None on timeout.

        On timeout the socket is closed, so a late reply cannot confuse a later request.
        """
        sock, binding = self.send(address, message)
        reply = wait_reply(self.codec, sock, message.seq, deadline, binding)
        if reply is None:
            self.drop(address)
        return reply
