"""A raw client of the IO engine's wire protocol, for the chaos harness and the tests.

It speaks the control-plane handshake without a secret (a peer with the secret
is a real engine) and builds TCP data-channel frames, so hostile or malformed
input can be sent on purpose. Protocol 2 is the current one; protocol 1 (before
the handshake was bound to its connection) is kept so a test can show that a
hole existed on an older build. See mori_core/csrc/io/net/control_plane.hpp and
io/tcp/wire.hpp for the formats.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Optional

__all__ = [
    "HELLO_MAGIC",
    "FRAME_MAGIC",
    "recv_msg",
    "send_msg",
    "raw_handshake",
    "request_header",
    "reply_header_size",
    "read_reply",
]

HELLO_MAGIC = 0x4F49524D
FRAME_MAGIC = 0x46434D54
CHANNEL_TCP_DATA = 1


def send_msg(sock: socket.socket, body: bytes) -> None:
    """One handshake message: u32 length + body."""
    sock.sendall(struct.pack("<I", len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; ConnectionError if the peer closes first."""
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        out += chunk
    return out


def recv_msg(sock: socket.socket) -> bytes:
    """One handshake message (u32 length + body)."""
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    if n > 1 << 16:
        raise ConnectionError(f"handshake message of {n} bytes")
    return recv_exact(sock, n)


def server_version(hello: bytes) -> int:
    """Protocol version of a server hello."""
    magic, version = struct.unpack_from("<IH", hello)
    if magic != HELLO_MAGIC:
        raise ConnectionError("not a MORI-IO engine")
    return version


def raw_handshake(port: int, key: str = "raw-client", version: int = 2, host: str = "127.0.0.1",
                  channel: int = CHANNEL_TCP_DATA, timeout: float = 5.0) -> tuple[socket.socket, bytes]:
    """Connect and handshake without a secret; returns (socket, final server message).

    The final message starts with the verdict byte (1 = accepted).
    """
    s = socket.create_connection((host, port), timeout=timeout)
    nonce = os.urandom(32)
    kb = key.encode()
    if version == 1:
        send_msg(s, struct.pack("<IHBB", HELLO_MAGIC, 1, channel, 0) + struct.pack("<I", len(kb)) + kb + nonce)
        recv_msg(s)
        send_msg(s, bytes(32))
    else:
        send_msg(s, struct.pack("<IHB", HELLO_MAGIC, 2, channel) + nonce)
        recv_msg(s)
        send_msg(s, struct.pack("<I", len(kb)) + kb + bytes(32))
    return s, recv_msg(s)


def request_header(version: int = 2, op: int = 1, flags: int = 0, mem: int = 1, nseg: int = 1, req: int = 1,
                   uid: int = 1, total: int = 8, notify: int = 0, magic: int = FRAME_MAGIC,
                   tag: Optional[bytes] = None) -> bytes:
    """A request header (op 1 = write, 2 = read); protocol 2 appends a 16-byte tag (zero = none)."""
    h = struct.pack("<IBBHIIQQQII", magic, op, flags, 0, mem, nseg, req, uid, total, notify, 0)
    return h if version == 1 else h + (tag if tag is not None else bytes(16))


def reply_header_size(version: int = 2) -> int:
    """Bytes of a reply header."""
    return 24 if version == 1 else 40


def read_reply(sock: socket.socket, version: int = 2) -> tuple[int, int, int, bytes]:
    """(kind, code, request id, message) of one reply (kind 1 ack, 2 read data, 3 error)."""
    raw = recv_exact(sock, reply_header_size(version))
    _magic, kind, code, mlen, req, _nbytes = struct.unpack_from("<IBBHQQ", raw)
    return kind, code, req, recv_exact(sock, mlen)
