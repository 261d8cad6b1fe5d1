"""ZMQ socket set-up of the control planes: small frames, and authentication at the connection.

Why not just ``MAXMSGSIZE`` and ``RCVHWM``: libzmq receives a whole message before the
application sees any of it. ``MAXMSGSIZE`` bounds one *frame* (checked at the frame
header, before anything is allocated) and ``RCVHWM`` counts *messages*, so a peer that
speaks raw ZMTP can send frame after frame with the "more" flag and never end the
message; libzmq keeps every frame (measured: +188 MiB for 3,000 x 64 KiB frames, with
``MAXMSGSIZE`` 65 KiB and ``RCVHWM`` 4). No check of the application can run before
that memory is spent.

So, with a shared secret, every listener is a CURVE server and every client a CURVE
client, their keys derived from the secret, and a ZAP handler (pyzmq's
``ThreadAuthenticator``) admits only the client key derived from the same secret. A peer
without the secret never gets past the CURVE handshake; until then libzmq holds at most
one handshake frame of that connection (at most ``MAXMSGSIZE`` bytes), and drops the
connection after ``HANDSHAKE_IVL``. Authenticated peers hold the secret and are trusted
(docs/reliability.md, threat model); their messages are still signed and checked by
:class:`~.control_codec.ControlCodec`, bound to their recipient.

Listener options are copied by libzmq when it binds, so :func:`secure_listener` must be
called before ``bind``.

Without a secret nothing is authenticated: frames stay bounded (a 60 MiB frame is cut at
its header), but a raw-ZMTP peer can still make libzmq buffer an endless multipart
message. Set a secret wherever the control ports are reachable by others.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Tuple

import zmq
from zmq.utils import z85

__all__ = [
    "CurveKeys",
    "bound_context",
    "HANDSHAKE_IVL_MS",
    "LISTENER_RCVHWM",
    "close_listener",
    "curve_available",
    "curve_keys",
    "secure_client",
    "secure_listener",
]

logger = logging.getLogger(__name__)

HANDSHAKE_IVL_MS = 5000  # an unauthenticated connection is dropped after this
LISTENER_RCVHWM = 64  # messages queued per connection before libzmq stops reading it


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE key pairs derived from one shared secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    zap_domain: str  # tells listeners of different secrets in one context apart


def curve_available() -> bool:
    """Whether this libzmq has CURVE (pyzmq's wheels do)."""
    return bool(zmq.has("curve"))


@lru_cache(maxsize=16)
def curve_keys(secret: bytes) -> CurveKeys:
    """Both key pairs of ``secret``: X25519 secret keys = HMAC-SHA256(secret, label)."""
    if not secret:
        raise ValueError("curve_keys: the shared secret is empty")

    def pair(label: bytes) -> Tuple[bytes, bytes]:
        sk = z85.encode(hmac.new(secret, label, hashlib.sha256).digest())
        return zmq.curve_public(sk), sk

    spub, ssec = pair(b"mori-suite zmq curve server v1")
    cpub, csec = pair(b"mori-suite zmq curve client v1")
    domain = "mori-suite-" + hmac.new(secret, b"mori-suite zap domain v1", hashlib.sha256).hexdigest()[:16]
    return CurveKeys(spub, ssec, cpub, csec, domain)


class _Zap:
    """One ZAP handler per ZMQ context, shared by that context's listeners (reference counted)."""

    def __init__(self, ctx: zmq.Context) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.allowed: Dict[str, bytes] = {}  # ZAP domain -> the one client key it admits
        self.users = 0
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("mori_integrations.zap"))
        self.auth.start()

    def allow(self, domain: str, client_key: bytes) -> None:
        """Admit ``client_key`` on listeners of ``domain``."""
        if domain not in self.allowed:
            self.allowed[domain] = client_key
            self.auth.configure_curve_callback(domain, self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP decision (on the authenticator's thread)."""
        expected = self.allowed.get(domain)
        return expected is not None and hmac.compare_digest(expected, client_key)


_zaps: Dict[int, _Zap] = {}
_zaps_lock = threading.Lock()
_warned_no_curve = False


def secure_listener(sock: zmq.Socket, secret: bytes, max_frame_bytes: int, rcvhwm: int = LISTENER_RCVHWM) -> bool:
    """Bound ``sock``'s frames and queue and, with ``secret``, make it a CURVE server. Before ``bind``.

    Returns True when the socket authenticates its connections (close it with
    :func:`close_listener` then, to release the context's ZAP handler).
    """
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    if not secret or not _curve_or_warn():
        return False
    keys = curve_keys(secret)
    ctx = sock.context
    with _zaps_lock:
        zap = _zaps.get(id(ctx))
        if zap is None:
            zap = _zaps[id(ctx)] = _Zap(ctx)
        zap.allow(keys.zap_domain, keys.client_public)
        zap.users += 1
    sock.setsockopt_string(zmq.ZAP_DOMAIN, keys.zap_domain)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    return True


def bound_context(ctx: zmq.Context, max_frame_bytes: int, rcvhwm: int = LISTENER_RCVHWM) -> None:
    """Make the frame and queue bounds defaults of every socket ``ctx`` creates from now on.

    For listeners bound by code that is not ours (SGLang binds its PD control socket
    inside ``CommonKVManager.__init__``): options set after ``bind`` do not reach the
    connections it accepts. No CURVE here: the peers' sockets are not ours either.
    """
    ctx.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    ctx.setsockopt(zmq.RCVHWM, rcvhwm)
    ctx.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


def close_listener(sock: zmq.Socket, authenticated: bool) -> None:
    """Close a socket set up by :func:`secure_listener` (the ZAP handler stops with the
    context's last authenticated listener, so the context can then be terminated)."""
    ctx = sock.context
    sock.close(linger=0)
    if not authenticated:
        return
    with _zaps_lock:
        zap = _zaps.get(id(ctx))
        if zap is None:
            return
        zap.users -= 1
        if zap.users > 0:
            return
        del _zaps[id(ctx)]
    zap.auth.stop()


def secure_client(sock: zmq.Socket, secret: bytes, max_frame_bytes: int) -> None:
    """Bound the frames ``sock`` accepts and, with ``secret``, make it a CURVE client. Before ``connect``."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    if not secret or not _curve_or_warn():
        return
    keys = curve_keys(secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def _curve_or_warn() -> bool:
    global _warned_no_curve
    if curve_available():
        return True
    if not _warned_no_curve:
        _warned_no_curve = True
        logger.warning(
            "this libzmq has no CURVE support: control connections are not authenticated, only their "
            "messages are (a peer without the secret can still make libzmq buffer large multipart "
            "messages). Install pyzmq's wheel, which bundles a libzmq with CURVE.")
    return False
