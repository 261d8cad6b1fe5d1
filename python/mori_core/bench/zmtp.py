"""Raw ZMTP 3.0 for attack scripts: what a peer that speaks TCP, not libzmq, can send a ZMQ listener.

libzmq's own sockets never send an unfinished multipart message nor a frame to a peer
whose handshake failed; an attacker is not bound by that. Only the pieces the chaos
harness needs: the greeting, the NULL mechanism's READY, and frames.
"""

from __future__ import annotations

import socket
import struct
from typing import Optional, Sequence

__all__ = ["GREETING_BYTES", "connect", "frame", "frame_header", "greeting", "message", "ready"]

GREETING_BYTES = 64


def greeting(mechanism: str = "NULL") -> bytes:
    """A client's greeting: signature, version 3.0, mechanism, as-server 0, filler."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.encode().ljust(20, b"\x00") + b"\x00" * 32


def ready(socket_type: str) -> bytes:
    """The NULL mechanism's READY command naming our socket type (PUSH, DEALER, ...)."""
    name, value = b"Socket-Type", socket_type.encode()
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return bytes([0x04, len(body)]) + body


def frame_header(size: int, more: bool = False, command: bool = False) -> bytes:
    """The header of a frame of ``size`` bytes (the body follows)."""
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    if size > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", size)
    return bytes([flags, size])


def frame(data: bytes, more: bool = False) -> bytes:
    return frame_header(len(data), more) + data


def message(frames: Sequence[bytes]) -> bytes:
    """One multipart message, as bytes on the wire."""
    return b"".join(frame(f, i < len(frames) - 1) for i, f in enumerate(frames))


def connect(port: int, socket_type: str = "PUSH", mechanism: str = "NULL", host: str = "127.0.0.1",
            source: Optional[str] = None, timeout_s: float = 5.0) -> socket.socket:
    """A TCP connection to a ZMQ listener after the greetings (and, with NULL, our READY).

    ``source`` binds the local address first (e.g. 127.1.2.3: one of many attacker addresses).
    Raises OSError when the listener closes the connection during the greeting.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        if source:
            s.bind((source, 0))
        s.connect((host, port))
        s.sendall(greeting(mechanism))
        _read(s, GREETING_BYTES)
        if mechanism == "NULL":
            s.sendall(ready(socket_type))
            flags, size = _read(s, 2)  # the listener's READY: read, so closing later sends FIN, not RST
            if flags & 0x02:
                size = struct.unpack(">Q", bytes([size]) + _read(s, 7))[0]
            _read(s, size)
    except BaseException:
        s.close()
        raise
    return s


def _read(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        if not chunk:
            raise ConnectionResetError("listener closed the connection during the handshake")
        got += chunk
    return got
