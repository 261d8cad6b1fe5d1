"""The sender's control-plane listener: a ZMQ ROUTER socket plus pull workers.

Plumbing only. The listener thread owns the socket: it decodes requests,
answers queries inline (a table lookup) and hands pulls — which wait for an
IO-engine write — to a thread pool. Workers queue their replies and wake the
listener through a pipe, because a ZMQ socket must only be used by one thread.
What a query or a pull *means* is decided by the callbacks it is given.

The socket is set up by :mod:`~mori_integrations.common.zmq_setup` before it binds:
small frames, a bounded queue per connection and, with a secret, CURVE authentication
of every connection (a peer without the secret gets nothing past the handshake).
Every message goes through the shared codec (``protocol.make_codec``): anything that
does not decode, is not authentic, or is addressed to another listener (a pull
captured on its way to another sender, :attr:`PullServer.address`) gets a
:class:`Rejected` reply; replies are bound to the request they answer. Bad requests
are logged at most once per peer address and a few times in total per interval,
with a summary of the rest. No input ends the listener thread.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import zmq

from mori_integrations.common.control_codec import ControlCodec
from mori_integrations.common.log_limit import RateLimitedLog, zmq_peer_address
from mori_integrations.common.net import canonical_tcp_address
from mori_integrations.common.zmq_setup import close_listener, secure_listener

from . import protocol
from .protocol import PullRequest, QueryRequest, Rejected

__all__ = ["PortInUseError", "PullServer"]

logger = logging.getLogger(__name__)

_MAX_QUEUED_PULLS = 4096
_POLL_MS = 100


class PortInUseError(RuntimeError):
    """The listener could not bind its port (in use, not local, no permission)."""


class PullServer:
    """Serve :class:`QueryRequest` / :class:`PullRequest` on ``tcp://host:port``.

    Binding happens in the constructor, so a busy port fails the caller at
    once (no silent fallback to another port: receivers compute this one).

    Args:
        ctx: ZMQ context.
        codec: decodes requests and encodes replies (signs them with a secret).
        host, port: where to listen.
        on_query: request -> reply, called on the listener thread (must be quick).
        on_pull: request -> reply, called on a worker thread (may wait on a transfer).
        num_workers: concurrent pulls.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        codec: ControlCodec,
        host: str,
        port: int,
        on_query: Callable[[QueryRequest], object],
        on_pull: Callable[[PullRequest], object],
        num_workers: int,
    ) -> None:
        self.address = f"tcp://{host}:{port}"
        self.recipient = canonical_tcp_address(self.address)  # what requests must be addressed to
        self._codec = codec
        self._bad = RateLimitedLog(logger, what="bad requests")
        self._on_query = on_query
        self._on_pull = on_pull
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        self._authenticated = secure_listener(sock, codec.secret, codec.max_frame_bytes)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as exc:
            close_listener(sock, self._authenticated)
            raise PortInUseError(
                f"MoriTransferEngineConnector cannot listen on {self.address}: {exc.strerror} "
                f"(errno {exc.errno}). Another process (or another TP rank/stage with the same "
                "port) holds it, or the host is not a local address. Pick a free zmq_port; "
                "receivers derive this port, so the connector does not fall back to another one."
            ) from exc
        self._sock = sock
        self._replies: collections.deque[list[bytes]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="omni-mori-pull")
        self._queued = 0
        self._queued_lock = threading.Lock()
        self._closing = False
        self._stop = threading.Event()
        self.malformed = 0
        self.rejected_busy = 0
        self._thread = threading.Thread(target=self._run, name="omni-mori-listener", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if self._wake_r in events:
                    self._drain_wake()
                self._flush_replies()
                if self._sock in events:
                    for _ in range(64):  # bounded burst, then flush replies again
                        try:
                            parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        source = zmq_peer_address(parts)
                        try:
                            self._handle([p.bytes for p in parts], source)
                        except Exception as exc:  # last resort: no request may end the listener
                            self.malformed += 1
                            self._bad.warning(source, "omni mori listener %s: request from %s failed: %r",
                                              self.address, source, exc)
                self._bad.tick()
            self._flush_replies()
        except zmq.ContextTerminated:
            pass
        except Exception:  # keep the reason; the connector's health() reports the dead listener
            logger.exception("omni mori listener on %s stopped", self.address)
        finally:
            close_listener(self._sock, self._authenticated)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _flush_replies(self) -> None:
        while self._replies:
            frames = self._replies.popleft()
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the peer went away: nothing to deliver to
                logger.debug("dropping reply to a gone peer: %s", exc)

    def _reply(self, identity: bytes, message: object, binding: bytes) -> None:
        """Queue ``message`` to the peer ``identity``, bound to its request (``binding``)."""
        self._replies.append([identity, *self._codec.encode(message, recipient=binding)])
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # pipe full: the listener is awake anyway
            pass

    def _handle(self, frames: list[bytes], source: str) -> None:
        if len(frames) < 2:
            self.malformed += 1
            return
        identity, body = frames[0], frames[1:]
        binding = self._codec.reply_binding(body)
        try:
            request = self._codec.decode(body, recipient=self.recipient)
            if not isinstance(request, protocol.REQUESTS):
                raise protocol.ProtocolError(f"{type(request).__name__} is not a request")
        except protocol.ProtocolError as exc:
            self.malformed += 1
            self._bad.warning(source, "omni mori listener %s: refused a request from %s: %s", self.address, source, exc)
            self._reply(identity, Rejected(seq=0, reason=str(exc)[: protocol.MAX_ERROR_CHARS]), binding)
            return
        if isinstance(request, QueryRequest):
            self._reply(identity, self._on_query(request), binding)
            return
        with self._queued_lock:
            refuse = "connector is closing" if self._closing else (
                "too many pulls queued" if self._queued >= _MAX_QUEUED_PULLS else "")
            if not refuse:
                self._queued += 1
        if refuse:
            self.rejected_busy += 1
            self._reply(identity, Rejected(seq=request.seq, reason=refuse), binding)
            return
        self._workers.submit(self._serve_pull, identity, request, binding)

    def _serve_pull(self, identity: bytes, request: PullRequest, binding: bytes) -> None:
        try:
            reply = self._on_pull(request)
        except Exception as exc:  # on_pull answers errors itself; this is the last resort
            logger.exception("pull handler failed for %r", request.key)
            reply = protocol.PullResponse(seq=request.seq, key=request.key, ok=False,
                                          error=f"sender error: {exc}"[: protocol.MAX_ERROR_CHARS])
        finally:
            with self._queued_lock:
                self._queued -= 1
        self._reply(identity, reply, binding)

    # ------------------------------------------------------------- close
    @property
    def alive(self) -> bool:
        """True while the listener thread runs."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Refuse new pulls, let running ones finish and answer, then stop (idempotent)."""
        if self._stop.is_set():
            return
        with self._queued_lock:
            self._closing = True
        # Each pull is bounded by its transfer timeout, so this wait is bounded.
        self._workers.shutdown(wait=True)
        self._stop.set()
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            logger.warning("omni mori listener on %s did not stop within 5 s", self.address)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

