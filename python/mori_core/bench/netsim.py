"""Man-in-the-middle tools for the IO tests and the chaos harness: a throttling or
resetting TCP proxy and a handshake relay.

Both sit on a real loopback socket between two real engines; an engine is sent
to them by a descriptor whose port is rewritten (:func:`desc_at`).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Optional

__all__ = ["HandshakeRelay", "Proxy", "desc_at"]

from mori_core.bench.wire import recv_msg, send_msg, server_version
from mori_core.io import EngineDesc


def desc_at(desc: EngineDesc, port: int) -> EngineDesc:
    """``desc`` with its port replaced (same key: the engine believes it dials the real peer)."""
    packed = bytearray(desc.pack())
    pos = packed.rfind(struct.pack("<H", desc.port))
    packed[pos:pos + 2] = struct.pack("<H", port)
    out = EngineDesc.unpack(bytes(packed))
    assert out.port == port and out.key == desc.key
    return out


class Proxy:
    """Forwards every connection to ``127.0.0.1:target_port``, at most ``rate`` bytes/s per
    direction; with ``reset_after``, a connection that carried that many bytes from the
    client is reset on both sides (an RST in the middle of a frame)."""

    def __init__(self, target_port: int, rate: Optional[float] = None, chunk: int = 4096,
                 reset_after: Optional[int] = None) -> None:
        self._target = target_port
        self._rate = rate
        self._chunk = chunk
        self._reset_after = reset_after
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                a, _ = self._srv.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [a, b]
            for src, dst, upstream in ((a, b, True), (b, a, False)):
                threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        moved = 0
        try:
            while not self._stop.is_set():
                data = src.recv(self._chunk)
                if not data:
                    break
                dst.sendall(data)
                moved += len(data)
                if upstream and self._reset_after is not None and moved >= self._reset_after:
                    for s in (src, dst):
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        s.close()
                    return
                if self._rate:
                    time.sleep(len(data) / self._rate)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        for s in self._socks:
            s.close()


class HandshakeRelay:
    """Accepts one connection (an honest engine that was handed a descriptor pointing
    here), forwards its handshake to the real target and keeps the target-side socket.

    The handshake is two messages each way (u32 length + body) in protocols 1 and 2,
    so the relay needs no secret: it only copies bytes. Afterwards :attr:`upstream` is
    an authenticated connection to the target — unless frames are bound to it.
    """

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(1)
        self.port = self._srv.getsockname()[1]
        self.upstream: Optional[socket.socket] = None
        self.victim: Optional[socket.socket] = None
        self.version = 0
        self.accepted = b""
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            self.victim, _ = self._srv.accept()
            self.victim.settimeout(10)
            up = socket.create_connection(("127.0.0.1", self._target), timeout=10)
            send_msg(up, recv_msg(self.victim))  # client hello
            hello = recv_msg(up)
            self.version = server_version(hello)
            send_msg(self.victim, hello)
            send_msg(up, recv_msg(self.victim))  # client proof
            final = recv_msg(up)
            send_msg(self.victim, final)
            self.accepted = final
            self.upstream = up
        finally:
            self.done.set()

    def close(self) -> None:
        for s in (self.upstream, self.victim, self._srv):
            if s is not None:
                s.close()
