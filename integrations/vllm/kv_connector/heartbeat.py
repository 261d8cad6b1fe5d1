"""Service registration with a MoRIIO-style router/proxy (``proxy_ip`` / ``proxy_ping_port``).

Same payload as vLLM 0.30's MoRIIOConnector, so routers written for it discover our
servers: every 3 s rank 0 sends msgpack ``{"type": "P"|"D", "http_address": "host:port",
"zmq_address": "host:IP,handshake:PORT,notify:PORT", "dp_size", "tp_size",
"transfer_mode": "WRITE"|"READ"}`` over a ZMQ DEALER socket. Sends never block; a router
that is down simply misses beats.
"""

from __future__ import annotations

import threading
from typing import Any, Dict

import msgspec
import zmq

__all__ = ["ProxyHeartbeat"]

INTERVAL_S = 3.0


class ProxyHeartbeat:
    """A daemon thread sending the registration payload until :meth:`close`."""

    def __init__(self, ctx: zmq.Context, proxy_ip: str, proxy_port: int, payload: Dict[str, Any]) -> None:
        self._body = msgspec.msgpack.encode(payload)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 4)
        self._sock.connect(f"tcp://{proxy_ip}:{proxy_port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mori-kv-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sock.send(self._body, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # router down or slow: the next beat tries again
            self._stop.wait(INTERVAL_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(0)
