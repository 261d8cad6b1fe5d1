"""Rate-limited logging of bad input from the network.

A hostile or broken peer must not be able to flood the log, and neither may many of
them together (an attacker on loopback has 16 million source addresses). Two limits:

* one line per source per interval;
* at most ``max_lines`` lines per interval over all sources.

Every event that was not logged is counted, and one summary line per interval says
how many there were, from how many sources, and which source sent the most, so
nothing disappears without a count. A flood of any size from any number of
sources thus costs at most ``max_lines + 1`` lines per interval.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Optional

__all__ = ["RateLimitedLog", "warn_if_exposed", "is_loopback", "zmq_peer_address"]

_OTHER = "(other sources)"


class RateLimitedLog:
    """At most one line per source and ``max_lines`` lines in total per ``interval_s``, with counts.

    Args:
        logger: where lines go.
        interval_s: minimum time between two lines of one source; also the window of
            the total budget.
        max_lines: lines per window over all sources (the summary line excluded).
        max_sources: sources tracked at once (beyond, they share one bucket).
        what: what an event is, for the summary line (e.g. "bad control messages").
        clock: monotonic clock (injectable for tests).

    The summary line of a window is written by the first call of :meth:`warning` or
    :meth:`tick` after the window ended; a listener calls :meth:`tick` from its poll loop,
    so the summary comes even when the flood stops.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, max_lines: int = 5,
                 max_sources: int = 4096, what: str = "similar events",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_lines < 1:
            raise ValueError(f"RateLimitedLog: max_lines must be >= 1, got {max_lines}")
        self._logger = logger
        self._interval = interval_s
        self._max_lines = max_lines
        self._max = max_sources
        self._what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._sources: Dict[str, float] = {}  # source -> time of its last line
        self._window_start = clock()
        self._window_lines = 0
        self._dropped: Dict[str, int] = {}  # events of this window not logged, per source
        self.events = 0  # every event, logged or not
        self.lines = 0  # lines written (summaries included)

    def warning(self, source: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` for ``source`` unless a limit says no; True if logged."""
        now = self._clock()
        with self._lock:
            self.events += 1
            summary = self._roll(now)
            if source not in self._sources and len(self._sources) >= self._max:
                self._sources = {k: t for k, t in self._sources.items() if now - t < self._interval}
                if len(self._sources) >= self._max:
                    source = _OTHER
            last = self._sources.get(source)
            logged = (last is None or now - last >= self._interval) and self._window_lines < self._max_lines
            if logged:
                self._sources[source] = now
                self._window_lines += 1
                self.lines += 1
            else:
                bucket = source if source in self._dropped or len(self._dropped) < self._max else _OTHER
                self._dropped[bucket] = self._dropped.get(bucket, 0) + 1
        self._write(summary)
        if logged:
            self._logger.warning(msg, *args)
        return logged

    def tick(self) -> None:
        """Write the summary of a window that has ended (cheap; call it from a poll loop)."""
        now = self._clock()
        if now - self._window_start < self._interval:
            return
        with self._lock:
            summary = self._roll(now)
        self._write(summary)

    def _roll(self, now: float) -> Optional[str]:
        """Start a new window if the current one ended; its summary text, if any (lock held)."""
        if now - self._window_start < self._interval:
            return None
        dropped, self._dropped = self._dropped, {}
        self._window_start = now
        self._window_lines = 0
        if not dropped:
            return None
        self.lines += 1
        top, top_n = max(dropped.items(), key=lambda kv: kv[1])
        return (f"{sum(dropped.values())} more {self._what} from {len(dropped)} source(s) were not logged "
                f"in the last {self._interval:g} s (at most one line per source and {self._max_lines} in total per "
                f"{self._interval:g} s; busiest source {top}: {top_n})")

    def _write(self, summary: Optional[str]) -> None:
        if summary is not None:
            self._logger.warning("%s", summary)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'."""
    h = host.strip().strip("[]").lower()
    return h == "localhost" or h == "::1" or h.startswith("127.")


def warn_if_exposed(logger: logging.Logger, what: str, host: str, authenticated: bool) -> bool:
    """Warn once at start when ``what`` listens unauthenticated beyond loopback; True if it warned."""
    if authenticated or is_loopback(host):
        return False
    logger.warning(
        "%s listens on %s without authentication: anyone who reaches this address can send it control "
        "messages (and the IO engine's memory is open to them too). Set the same auth_secret / "
        "MORI_IO_AUTH_SECRET on every peer, or bind a loopback/private address. See docs/reliability.md.",
        what, host)
    return True


def zmq_peer_address(parts: list) -> str:
    """The sender's IP address from a message received with ``copy=False`` (ZMQ frame
    metadata), or '?'; the unit of log rate limiting."""
    try:
        return str(parts[0].get("Peer-Address"))
    except Exception:  # libzmq without metadata, or an inproc peer
        return "?"
