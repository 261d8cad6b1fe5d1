"""The connector's control plane: per-worker listener, notification sender, metadata fetch.

One thread per worker serves two bound sockets (MoRIIO's two-port scheme): a ROUTER
answering :class:`GetMeta` and a PULL receiving notifications, and, where the host allows
it, a same-host inbox (:mod:`~mori_integrations.common.local_inbox`: the notify port's
messages as Unix datagrams, one thread wake-up instead of three, checked by the same codec). Both are set up by
:mod:`~mori_integrations.common.zmq_setup` before they bind: frames of at most the codec's
piece size (a larger frame drops the connection at its header), a bounded queue per
connection and, with a shared secret, CURVE authentication of every connection, so a peer
without the secret gets no message -- and no memory -- past the handshake. Every message is
decoded by the connector's codec: a notification must be addressed to this notify port and
a metadata reply to the request it answers. A bad message is dropped and logged, at most
one line per peer address and a few lines in total per interval (with a summary of what
was not logged). Without a shared secret any peer that reaches the ports can send valid
messages: the server warns at start when it binds beyond loopback that way. Handlers run
on this thread and must not block: anything slow is handed to the transfer threads (a write
request whose KV is ready is submitted here only when its batch just queues copies: XGMI).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

import zmq

from mori_integrations.common.control_codec import ControlCodec, ControlMessageError
from mori_integrations.common.timer_slack import short_timer_slack
from mori_integrations.common.local_inbox import LocalInbox, LocalSender, unpack_frames
from mori_integrations.common.log_limit import RateLimitedLog, zmq_peer_address, warn_if_exposed
from mori_integrations.common.net import refuses_connections
from mori_integrations.common.zmq_setup import close_listener, secure_client, secure_listener
from mori_integrations.vllm.kv_connector.messages import AgentMetadata, GetMeta

__all__ = ["ControlServer", "HandshakeError", "Notifier", "fetch_metadata", "notify_recipient"]

logger = logging.getLogger(__name__)

_POLL_MS = 200  # the listener wakes this often to notice shutdown
_SPIN_SLEEP_S = 20e-6  # between socket checks while spinning (see ControlServer.expect)
_SEND_HWM = 4096
_REFUSAL_CHECK_MS = 200  # a handshake unanswered this long checks whether anything listens at all


class HandshakeError(RuntimeError):
    """A peer's metadata could not be obtained (unreachable, timed out, refused, invalid)."""


def notify_recipient(host: str, port: int) -> str:
    """Whom a notification to ``host:port`` is bound to: the notify port's advertised address."""
    return f"{host}:{port}"


class ControlServer:
    """Serve GetMeta on ``handshake_port`` and notifications on ``notify_port`` (both bound on ``host``)."""

    def __init__(
        self,
        codec: ControlCodec,
        ctx: zmq.Context,
        host: str,
        handshake_port: int,
        notify_port: int,
        get_metadata: Callable[[], AgentMetadata],
        on_notify: Callable[[Any], None],
        name: str,
        inbox: Optional[LocalInbox] = None,
        spin_s: float = 0.0,
    ) -> None:
        """``inbox``: a same-host inbox (common.local_inbox) served as a second notify wire; closed with this.
        ``spin_s``: after :meth:`expect` or a handled message, poll without sleeping in the kernel
        for this long (see :meth:`expect`)."""
        self._codec = codec
        self._inbox = inbox
        self._spin_s = spin_s
        self._spin_until = 0.0
        self._blocked = False  # the thread sleeps in a blocking poll: expect() must wake it
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.inbox_messages = 0  # notifications that came through the inbox (tests and stats)
        self._get_metadata = get_metadata
        self._on_notify = on_notify
        self._stop = threading.Event()
        self._router = ctx.socket(zmq.ROUTER)
        self._pull = ctx.socket(zmq.PULL)
        self._authenticated = {}
        self._me = notify_recipient(host, notify_port)
        try:
            for sock in (self._router, self._pull):
                sock.setsockopt(zmq.LINGER, 0)
                self._authenticated[sock] = secure_listener(sock, codec.secret, codec.max_frame_bytes)
            self._router.bind(f"tcp://{host}:{handshake_port}")
            self._pull.bind(f"tcp://{host}:{notify_port}")
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeError(
                f"MoriSuiteConnector cannot listen on {host}:{handshake_port} (handshake) / {notify_port} (notify): "
                f"{e}. Ports are handshake_port/notify_port + dp_rank * tp_size + tp_rank; give each server "
                "on a host its own base ports."
            ) from e
        self.address = (host, handshake_port, notify_port)
        self.bad_messages = RateLimitedLog(logger, what="bad control messages")
        warn_if_exposed(logger, f"MoriSuiteConnector's KV side channel ({name})", host, codec.authenticated)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def expect(self) -> None:
        """A message is likely soon (a request's KV is ready for a decode's write request; a decode
        waits for writes): poll for the next ``spin_s`` instead of sleeping in the kernel.

        On an idle host a thread asleep in poll() takes 100-150 us to wake up when a message
        arrives; one that checks its sockets every ~20 us sees it within that. Costs one
        core's share of short sleeps while it lasts. No-op with ``spin_s`` 0.
        """
        if self._spin_s <= 0:
            return
        self._spin_until = time.monotonic() + self._spin_s
        if self._blocked:
            try:
                os.write(self._wake_w, b"w")
            except (BlockingIOError, OSError):  # already signalled, or closing
                pass

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        inbox_fd = self._inbox.fileno() if self._inbox is not None else None
        if inbox_fd is not None:
            poller.register(inbox_fd, zmq.POLLIN)
        while not self._stop.is_set():
            spinning = time.monotonic() < self._spin_until
            self._blocked = not spinning
            if self._blocked and time.monotonic() < self._spin_until:  # expect() raced the flag
                self._blocked, spinning = False, True
            try:
                ready = dict(poller.poll(0 if spinning else _POLL_MS))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("MoriSuiteConnector control socket error")
                continue
            self._blocked = False
            if not ready:
                self.bad_messages.tick()  # a quiet spell ends a flood's window: its summary line is due
                if spinning:
                    short_timer_slack()
                    time.sleep(_SPIN_SLEEP_S)
                continue
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 64)
                except BlockingIOError:
                    pass
            if self._spin_s > 0 and len(ready) > (self._wake_r in ready):  # a message: more may follow
                self._spin_until = max(self._spin_until, time.monotonic() + self._spin_s)
            # The inbox first: a datagram queued before a ZMQ message from the same sender was
            # even sent is handled before it (the sender's order across the two wires).
            if inbox_fd is not None and inbox_fd in ready:
                for data in self._inbox.receive():
                    self._serve_datagram(data)
            if self._router in ready:
                self._serve_one(self._router, reply=True)
            if self._pull in ready:
                self._serve_one(self._pull, reply=False)
            self.bad_messages.tick()

    def _serve_one(self, sock: zmq.Socket, reply: bool) -> None:
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return
        source = zmq_peer_address(parts)
        frames = [p.bytes for p in parts]
        identity = None
        if reply:
            if len(frames) < 2:
                return
            identity, frames = frames[0], frames[1:]
        try:
            if reply:  # anyone may ask for the metadata; the answer is bound to the request
                message = self._codec.decode(frames)
                if not isinstance(message, GetMeta):
                    raise ControlMessageError(f"{type(message).__name__} sent to the handshake port")
                answer = self._codec.encode(self._get_metadata(), recipient=self._codec.reply_binding(frames))
                sock.send_multipart([identity, *answer], zmq.NOBLOCK)
            else:
                self._on_notify(self._codec.decode(frames, recipient=self._me))
        except ControlMessageError as e:
            self.bad_messages.warning(source, "MoriSuiteConnector: dropped a control message from %s: %s", source, e)
        except zmq.ZMQError as e:
            self.bad_messages.warning(source, "MoriSuiteConnector: could not answer a handshake from %s: %s", source, e)
        except Exception as e:  # a bad message must not end the listener
            self.bad_messages.warning(source, "MoriSuiteConnector: failed to handle a control message from %s: %r",
                                      source, e)

    def _serve_datagram(self, data: bytes) -> None:
        """One inbox datagram: a notification, checked by the codec exactly as one from the notify port."""
        source = "the same-host inbox"
        try:
            message = self._codec.decode(unpack_frames(data), recipient=self._me)
            self.inbox_messages += 1
            self._on_notify(message)
        except (ControlMessageError, ValueError) as e:
            self.bad_messages.warning(source, "MoriSuiteConnector: dropped a control message from %s: %s", source, e)
        except Exception as e:  # a bad message must not end the listener
            self.bad_messages.warning(source, "MoriSuiteConnector: failed to handle a control message from %s: %r",
                                      source, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._router, self._pull):
            close_listener(sock, self._authenticated.get(sock, False))
        if self._inbox is not None:
            self._inbox.close()
        for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


class Notifier:
    """Send notifications to peers' notify ports (one cached PUSH socket per peer; never blocks)."""

    def __init__(self, codec: ControlCodec, ctx: zmq.Context, local: Optional[LocalSender] = None) -> None:
        """``local``: sends to peers' same-host inboxes (common.local_inbox); None: ZMQ only."""
        self._codec = codec
        self._ctx = ctx
        self._local = local
        self._lock = threading.Lock()
        self._sockets: Dict[Tuple[str, int], zmq.Socket] = {}

    def send(self, host: str, port: int, message: Any, inbox: str = "") -> bool:
        """Queue ``message`` for ``host:port``; False (logged) when it cannot be queued.

        ``inbox``: the peer's same-host inbox, tried first (the same frames; ZMQ when it is not
        on this host or cannot take it). Only for messages that may overtake earlier ZMQ ones.
        """
        frames = self._codec.encode(message, recipient=notify_recipient(host, port))
        if inbox and self._local is not None and self._local.send(inbox, frames):
            return True
        with self._lock:
            sock = self._sockets.get((host, port))
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
                sock.setsockopt(zmq.IMMEDIATE, 0)
                secure_client(sock, self._codec.secret, self._codec.max_frame_bytes)
                sock.connect(f"tcp://{host}:{port}")
                self._sockets[(host, port)] = sock
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.ZMQError as e:
                logger.warning("MoriSuiteConnector: notification to %s:%d dropped: %s", host, port, e)
                return False

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close(0)
            self._sockets.clear()
        if self._local is not None:
            self._local.close()



def fetch_metadata(
    codec: ControlCodec, ctx: zmq.Context, host: str, port: int, requester: str, timeout_s: float
) -> AgentMetadata:
    """Ask the worker listening on ``host:port`` for its metadata (bounded by ``timeout_s``).

    Fails at once when nothing listens on ``host:port`` (the connection is refused): ZMQ
    would retry silently until the timeout, but a dead server's KV is not coming back.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, codec.secret, codec.max_frame_bytes)
    try:
        sock.connect(f"tcp://{host}:{port}")
        request = codec.encode(GetMeta(requester=requester))
        sock.send_multipart(request)
        deadline = time.monotonic() + timeout_s
        if not sock.poll(min(int(timeout_s * 1000), _REFUSAL_CHECK_MS), zmq.POLLIN):
            if refuses_connections(host, port, max(0.001, deadline - time.monotonic())):
                raise HandshakeError(f"nothing listens on {host}:{port} (the KV connector's server is down)")
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
                raise HandshakeError(
                    f"no answer from the KV connector at {host}:{port} within {timeout_s:g} s "
                    "(server down, wrong handshake_port, or a different shared secret?)"
                )
        message = codec.decode(sock.recv_multipart(), recipient=codec.reply_binding(request))
    except ControlMessageError as e:
        raise HandshakeError(f"invalid handshake answer from {host}:{port}: {e}") from None
    except zmq.ZMQError as e:
        raise HandshakeError(f"handshake with {host}:{port} failed: {e}") from None
    finally:
        sock.close(0)
    if not isinstance(message, AgentMetadata):
        raise HandshakeError(f"{host}:{port} answered the handshake with {type(message).__name__}")
    return message
