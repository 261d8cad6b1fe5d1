"""A same-host inbox for control messages: one Unix datagram per message.

A ZMQ message between two processes of one idle host wakes three sleeping threads (the
sender's I/O thread, the receiver's, then the receiving thread): 150-210 us measured on H100
hosts, in front of every KV write a decode asks for. A datagram on an abstract Unix socket
wakes one: the receiving thread, blocked in the same poll as its ZMQ sockets.

The inbox carries exactly the frames the ZMQ path carries, encoded and checked by the same
codec (with a shared secret, every message is authenticated and bound to its recipient), so
it is another wire, not another protocol. It is best effort: a sender falls back to ZMQ
when the datagram cannot be queued (no such inbox on this host or network namespace, a full
receive queue, a message above the datagram limit), so nothing is lost. Messages that take
different wires may overtake each other; senders route only messages whose handlers
tolerate that (see the callers).

Abstract socket names live in the network namespace: there is no file to clean up, and a
process on another host, or in another container, simply is not found.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
from typing import List, Optional, Sequence

__all__ = ["LocalInbox", "LocalSender", "inbox_name", "pack_frames", "try_inbox", "unpack_frames"]

_MAGIC = b"MKI1"
_COUNT = struct.Struct("<H")
_LEN = struct.Struct("<I")
MAX_FRAMES = 16
MAX_DATAGRAM = 192 << 10  # below Linux's default socket buffer (208 KiB): larger messages go over ZMQ
_RECV_BURST = 64  # datagrams handled per poll wake-up before the other sockets get a turn


def inbox_name(engine_key: str) -> str:
    """The abstract socket name of the process whose IO engine is ``engine_key`` (unique per process)."""
    return "mori-kv-" + hashlib.sha256(engine_key.encode()).hexdigest()[:32]


def pack_frames(frames: Sequence[bytes]) -> bytes:
    """One datagram holding ``frames`` (ValueError beyond MAX_FRAMES)."""
    if len(frames) > MAX_FRAMES:
        raise ValueError(f"{len(frames)} frames, at most {MAX_FRAMES} fit one datagram")
    return b"".join([_MAGIC, _COUNT.pack(len(frames)), *(_LEN.pack(len(f)) for f in frames), *frames])


def unpack_frames(data: bytes) -> List[bytes]:
    """The frames of one datagram (ValueError, naming what is wrong, for anything else)."""
    if len(data) < len(_MAGIC) + _COUNT.size or data[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not an inbox datagram (bad magic)")
    (n,) = _COUNT.unpack_from(data, len(_MAGIC))
    if not 1 <= n <= MAX_FRAMES:
        raise ValueError(f"{n} frames (1 to {MAX_FRAMES})")
    pos = len(_MAGIC) + _COUNT.size
    if len(data) < pos + n * _LEN.size:
        raise ValueError("truncated frame table")
    sizes = [_LEN.unpack_from(data, pos + i * _LEN.size)[0] for i in range(n)]
    pos += n * _LEN.size
    if pos + sum(sizes) != len(data):
        raise ValueError(f"frame sizes add up to {sum(sizes)} B, the datagram carries {len(data) - pos} B")
    frames = []
    for size in sizes:
        frames.append(data[pos : pos + size])
        pos += size
    return frames


class LocalInbox:
    """The receiving end (non-blocking socket; its owner polls :meth:`fileno` and calls :meth:`receive`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind("\0" + name)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def receive(self) -> List[bytes]:
        """The datagrams queued now (at most a burst; never blocks)."""
        out = []
        for _ in range(_RECV_BURST):
            try:
                out.append(self._sock.recv(MAX_DATAGRAM + 1))
            except (BlockingIOError, InterruptedError):
                break
        return out

    def close(self) -> None:
        self._sock.close()


class LocalSender:
    """Sends datagrams to inboxes on this host; :meth:`send` says whether one was queued. Thread-safe."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._lock = threading.Lock()
        self._closed = False

    def send(self, name: str, frames: Sequence[bytes]) -> bool:
        """Queue ``frames`` for inbox ``name``; False when they must take another wire."""
        try:
            data = pack_frames(frames)
        except ValueError:
            return False
        if len(data) > MAX_DATAGRAM:
            return False
        with self._lock:
            if self._closed:
                return False
            try:
                self._sock.sendto(data, "\0" + name)
                return True
            except OSError:  # ECONNREFUSED: no such inbox here; EAGAIN: its queue is full; EMSGSIZE; ...
                return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._sock.close()


def try_inbox(name: str) -> Optional[LocalInbox]:
    """An inbox named ``name``, or None where this host refuses one (the owner then uses ZMQ only)."""
    try:
        return LocalInbox(name)
    except OSError:
        return None
