"""Watch the producers a consumer waits on in WRITE mode; report those whose process is gone.

In WRITE mode the decode only waits: the prefill writes, then says so. If the prefill process
dies, nothing else ends that wait before ``recv_abort_timeout`` (120 s by default). Once a
WRITE has waited one probe interval, each producer it waits on is checked every interval:

* its handshake port refuses TCP connections: no process listens there any more;
* it answers the handshake as another engine: the server restarted on the same ports.

Either proves that the process the request was sent to is gone and can write nothing more,
so the request may end at once. A producer that is only slow (it accepts the connection but
does not answer within the interval) proves nothing: its requests keep the
``recv_abort_timeout`` bound, because it may still write into their blocks.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Optional, Tuple

import zmq

from mori_core.io import EngineDesc
from mori_integrations.common.control_codec import ControlCodec
from mori_integrations.common.net import refuses_connections
from mori_integrations.vllm.kv_connector.control import HandshakeError, fetch_metadata

__all__ = ["Address", "PROBE_INTERVAL_S", "PeerWatch"]

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
Address = Tuple[str, int]  # (host, handshake port of one producer rank)


class PeerWatch:
    """A thread that probes the producers ``watched()`` names, every ``interval_s``.

    Args:
        codec, ctx: the agent's control-plane codec and ZMQ context.
        requester: this worker's engine key (sent with the handshake).
        watched: handshake address -> engine key the consumer expects there (called on the
            watch thread; must be quick and thread-safe).
        on_gone: ``(address, expected key, reason)`` for a producer whose process is gone
            (called on the watch thread).
    """

    def __init__(
        self,
        codec: ControlCodec,
        ctx: zmq.Context,
        requester: str,
        watched: Callable[[], Dict[Address, str]],
        on_gone: Callable[[Address, str, str], None],
        interval_s: float = PROBE_INTERVAL_S,
        name: str = "mori-kv-watch",
    ) -> None:
        self._codec = codec
        self._ctx = ctx
        self._requester = requester
        self._watched = watched
        self._on_gone = on_gone
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def probe(self, address: Address, key: str) -> Optional[str]:
        """Why the process with engine ``key`` at ``address`` is gone, or None if that is not proven."""
        host, port = address
        if refuses_connections(host, port, self._interval):
            return f"nothing listens on {host}:{port} any more (the prefill process is gone)"
        try:
            meta = fetch_metadata(self._codec, self._ctx, host, port, self._requester, self._interval)
            now_key = EngineDesc.unpack(meta.engine_desc).key
        except (HandshakeError, ValueError, RuntimeError):
            return None  # slow or not answering: it may still write
        if now_key != key:
            return f"{host}:{port} is now engine {now_key}, not {key} (the prefill restarted)"
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                targets = self._watched()
                for address, key in targets.items():
                    if self._stop.is_set():
                        return
                    reason = self.probe(address, key)
                    if reason is not None:
                        self._on_gone(address, key, reason)
            except Exception:  # the watch must outlive any one bad probe
                logger.exception("MoriSuiteConnector: producer liveness probe failed")

    def close(self) -> None:
        """Stop the thread (it ends within one probe: about two intervals)."""
        self._stop.set()
        self._thread.join(timeout=3 * self._interval + 1)
