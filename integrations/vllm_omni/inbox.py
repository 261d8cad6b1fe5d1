"""Receiver-side table of *parked* pulls: pulls whose caller stopped waiting first.

The rule that makes deadlines and abandoned gets safe: a destination buffer is
given back only once the sender answered the pull (its write into the buffer
has then ended), or once a bound far past the sender's own write bound passed
without any answer (the sender is gone). Until then the pull stays here with
the socket its answer will arrive on. A later get of the same key resumes it;
an abandoned one is only waited out.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional

import zmq

from mori_integrations.common.control_codec import ControlCodec

from .client import wait_reply
from .pool import PoolBuffer
from .protocol import PullResponse

__all__ = ["ParkedPull", "ParkedPulls"]


@dataclass(eq=False)
class ParkedPull:
    """One pull in flight (sent, not yet answered or not yet collected)."""

    key: str
    tag: str  # the caller's own key, for abandon()
    address: str
    sock: zmq.Socket
    seq: int
    buffer: PoolBuffer
    is_fast_path: bool
    started: float
    give_up_at: float
    detached: bool = False  # the socket left the thread's cache and belongs to this pull
    abandoned: bool = False
    done: Optional[PullResponse] = None  # the sender's answer, once it came
    codec: Optional[ControlCodec] = None  # decodes (and authenticates) the answer
    reply_binding: bytes = b""  # what the answer must be bound to (the pull request it answers)

    def poll_answer(self) -> None:
        """Look for the sender's answer without blocking (sets :attr:`done`)."""
        if self.done is not None:
            return
        reply = wait_reply(self.codec, self.sock, self.seq, 0.0, self.reply_binding)
        if reply is None:
            return
        if not isinstance(reply, PullResponse):
            reply = PullResponse(seq=self.seq, key=self.key, ok=False,
                                 error=getattr(reply, "reason", "payload no longer offered"))
        self.done = reply

    def settle(self) -> None:
        """Close the socket and give the buffer back (or quarantine it for good if the
        sender said its write may still be running)."""
        if self.detached:
            self.sock.close(linger=0)
        if self.done is not None and self.done.write_pending:
            self.buffer.leak()
        else:
            self.buffer.release()


class ParkedPulls:
    """Thread-safe ``key -> ParkedPull``.

    Args:
        collect_ttl_s: an answered, not abandoned pull whose payload nobody
            collects is released after this long.
    """

    def __init__(self, collect_ttl_s: float) -> None:
        self._ttl = collect_ttl_s
        self._lock = threading.Lock()
        self._pulls: dict[str, ParkedPull] = {}
        self.abandoned_released = 0
        self.expired = 0

    def park(self, pull: ParkedPull) -> None:
        """Keep ``pull`` until answered (a parked pull of the same key is settled)."""
        with self._lock:
            old = self._pulls.get(pull.key)
            self._pulls[pull.key] = pull
        if old is not None and old is not pull:
            old.settle()

    def take(self, key: str) -> Optional[ParkedPull]:
        """Remove and return the resumable pull of ``key`` (None if absent or abandoned)."""
        with self._lock:
            pull = self._pulls.get(key)
            if pull is None or pull.abandoned:
                return None
            return self._pulls.pop(key)

    def abandon(self, tag: str) -> int:
        """Mark the pulls of the caller key ``tag`` abandoned; returns how many."""
        with self._lock:
            pulls = [p for p in self._pulls.values() if p.tag == tag and not p.abandoned]
            for p in pulls:
                p.abandoned = True
        return len(pulls)

    def reap(self) -> None:
        """Settle abandoned pulls that got their answer, and any pull past its bounds."""
        now = time.monotonic()
        settle: list[ParkedPull] = []
        with self._lock:
            for key, pull in list(self._pulls.items()):
                try:
                    pull.poll_answer()
                except zmq.ZMQError:
                    pass
                answered = pull.done is not None
                hopeless = now >= pull.give_up_at
                uncollected = answered and not pull.abandoned and now - pull.started > self._ttl
                if (answered and pull.abandoned) or hopeless or uncollected:
                    del self._pulls[key]
                    settle.append(pull)
                    if pull.abandoned and answered:
                        self.abandoned_released += 1
                    else:
                        self.expired += 1
        for pull in settle:
            pull.settle()

    def drain(self) -> None:
        """Close every parked pull's socket (close: the pool is deregistered next, so
        late writes into it are refused by the IO engine)."""
        with self._lock:
            pulls, self._pulls = list(self._pulls.values()), {}
        for pull in pulls:
            pull.sock.close(linger=0)

    def stats(self) -> dict[str, int]:
        """Counts for ``health()``."""
        with self._lock:
            return {"parked_pulls": len(self._pulls),
                    "abandoned_pending": sum(1 for p in self._pulls.values() if p.abandoned),
                    "abandoned_released": self.abandoned_released, "parked_expired": self.expired}
