"""Sender-side table of payloads waiting to be pulled, with in-flight pins.

The rule that closes the stock connector's TTL race: a buffer is given back to
the pool only when its entry is *retired* (consumed, cleaned up, replaced or
expired) **and** no transfer reads it (``pins == 0``). Retiring an entry hides
it from new queries and pulls at once; the bytes stay put until the last
in-flight write that reads them has finished.

A caller's own buffer published zero-copy (``owns_buffer=False``) is *held*
(:meth:`PoolBuffer.hold`) for as long as its entry lives, so the caller's
``release()`` right after ``put`` cannot hand the bytes to a later allocation
before the receiver pulled them (issue #29: it got another payload's bytes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .pool import PoolBuffer

__all__ = ["OutboxEntry", "Outbox", "KeyBusyError", "PullRefused"]


class KeyBusyError(RuntimeError):
    """``put`` of a key whose previous payload is being transferred right now."""


class PullRefused(Exception):
    """A pull that cannot be served; ``reason`` goes back to the receiver."""

    def __init__(self, reason: str, not_found: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.not_found = not_found


@dataclass(eq=False)
class OutboxEntry:
    """One published payload."""

    key: str
    buffer: PoolBuffer
    is_fast_path: bool
    created: float
    owns_buffer: bool = True  # False: the caller's own pool buffer (zero-copy put)
    pins: int = 0
    retired: bool = False

    @property
    def size(self) -> int:
        return self.buffer.size


class Outbox:
    """Thread-safe ``key -> OutboxEntry`` map with pin counting and a TTL sweep.

    Args:
        ttl_s: entries older than this that no transfer reads are reclaimed.
        clock: monotonic clock (injectable for tests of the sweep).
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, OutboxEntry] = {}
        self.ttl_reclaimed = 0
        self.ttl_skipped_in_flight = 0

    # ------------------------------------------------------------ publish
    def add(self, key: str, buffer: PoolBuffer, is_fast_path: bool, owns_buffer: bool = True) -> None:
        """Publish ``buffer`` under ``key``; an idle older payload of the key is replaced.

        Raises:
            KeyBusyError: the older payload is being transferred (it is kept).
        """
        entry = OutboxEntry(key, buffer, is_fast_path, self._clock(), owns_buffer)
        with self._lock:
            old = self._entries.get(key)
            if old is not None and old.pins > 0:
                raise KeyBusyError(f"payload {key!r} is being transferred; cannot replace it now")
            if not owns_buffer:
                buffer.hold()  # RuntimeError if the caller released it already: nothing published
            self._entries[key] = entry
            to_free = self._retire_locked(old) if old is not None else None
        _release(to_free)

    def info(self, key: str) -> Optional[tuple[int, bool]]:
        """``(size, is_fast_path)`` of a live entry, else None."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else (entry.size, entry.is_fast_path)

    # -------------------------------------------------------------- pulls
    def pin(self, key: str, length: int) -> OutboxEntry:
        """Mark ``key`` as read by one more transfer and return its entry.

        Raises:
            PullRefused: unknown/retired key, or ``length`` differs from the
                payload size (a shorter pull would truncate it, a longer one
                would read past it into a neighbour's bytes).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise PullRefused(f"no payload under key {key!r}", not_found=True)
            if length != entry.size:
                raise PullRefused(f"pull of {length} bytes for {key!r}, whose payload is {entry.size} bytes")
            entry.pins += 1
            return entry

    def unpin(self, entry: OutboxEntry, consumed: bool) -> None:
        """End one transfer of ``entry``; ``consumed`` retires the entry (1 sender -> 1 receiver)."""
        with self._lock:
            entry.pins -= 1
            if consumed and not entry.retired:
                if self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]
                entry.retired = True
            to_free = entry if entry.retired and entry.pins == 0 else None
        _release(to_free)

    # ----------------------------------------------------------- removal
    def discard(self, key: str) -> bool:
        """Retire ``key`` now; its bytes are freed once no transfer reads them.

        Returns True if the key existed.
        """
        with self._lock:
            entry = self._entries.pop(key, None)
            to_free = self._retire_locked(entry) if entry is not None else None
        _release(to_free)
        return entry is not None

    def sweep(self) -> list[str]:
        """Retire entries older than the TTL that no transfer reads; returns their keys."""
        now = self._clock()
        reclaimed: list[OutboxEntry] = []
        with self._lock:
            for key, entry in list(self._entries.items()):
                if now - entry.created <= self.ttl_s:
                    continue
                if entry.pins > 0:
                    self.ttl_skipped_in_flight += 1  # the race the stock connector had
                    continue
                del self._entries[key]
                entry.retired = True
                reclaimed.append(entry)
            self.ttl_reclaimed += len(reclaimed)
        for entry in reclaimed:
            _release(entry)
        return [e.key for e in reclaimed]

    def drain(self) -> int:
        """Retire everything (close); returns how many entries were still pinned."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            frees = [self._retire_locked(e) for e in entries]
            pinned = sum(1 for e in entries if e.pins > 0)
        for entry in frees:
            _release(entry)
        return pinned

    def _retire_locked(self, entry: OutboxEntry) -> Optional[OutboxEntry]:
        entry.retired = True
        return entry if entry.pins == 0 else None

    # ------------------------------------------------------------- stats
    def stats(self) -> dict[str, int]:
        """Counts for ``health()``."""
        with self._lock:
            return {
                "outbox_entries": len(self._entries),
                "outbox_in_flight": sum(1 for e in self._entries.values() if e.pins > 0),
                "ttl_reclaimed": self.ttl_reclaimed,
                "ttl_skipped_in_flight": self.ttl_skipped_in_flight,
            }


def _release(entry: Optional[OutboxEntry]) -> None:
    """A retired, unpinned entry gives its bytes up: ours back to the pool, a caller's held one let go."""
    if entry is None:
        return
    if entry.owns_buffer:
        entry.buffer.release()
    else:
        entry.buffer.unhold()
