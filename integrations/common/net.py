"""Host addresses for control planes and IO engines."""

from __future__ import annotations

import ipaddress
import socket
from functools import lru_cache

__all__ = ["WILDCARD_HOSTS", "canonical_tcp_address", "detect_local_ip", "refuses_connections", "resolve_host"]

WILDCARD_HOSTS = ("auto", "", "*", "0.0.0.0")


def detect_local_ip() -> str:
    """The IPv4 address this host uses for outgoing traffic (no packet is sent).

    Falls back to the hostname's address, then to 127.0.0.1.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP connect only selects a route
            return s.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def resolve_host(value: str) -> str:
    """Turn ``auto``/``*``/``0.0.0.0``/empty into this host's address; keep others."""
    return detect_local_ip() if value.strip().lower() in WILDCARD_HOSTS else value.strip()


def refuses_connections(host: str, port: int, timeout_s: float) -> bool:
    """True when ``host`` actively refuses a TCP connection to ``port``: no process listens there.

    A connection that succeeds, times out within ``timeout_s`` or fails otherwise (no route,
    name not resolved) gives False: only a refusal proves the listener is gone.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


@lru_cache(maxsize=1024)
def canonical_tcp_address(address: str) -> str:
    """``tcp://host:port`` with a host name replaced by its IPv4 address (IP literals kept).

    Both ends of a control connection name the listener this way, so a message bound to
    it is recognised whether the dialer used a name or the address the listener bound.
    A name that does not resolve is kept as it is.
    """
    if not address.startswith("tcp://"):
        return address
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep:
        return address
    bare = host.strip("[]")
    try:
        ipaddress.ip_address(bare)
        return address
    except ValueError:
        pass
    try:
        return f"tcp://{socket.gethostbyname(bare)}:{port}"
    except OSError:
        return address
