"""Rate-limited logging of bad input from the network.

A hostile or broken peer must not be able to flood the log: at most one line
per (source, interval), each saying how many similar events were suppressed
since the previous line, so nothing disappears without a count.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Tuple

__all__ = ["RateLimitedLog", "warn_if_exposed", "is_loopback", "zmq_peer_address"]


class RateLimitedLog:
    """One log line per source per ``interval_s``, with counts.

    Args:
        logger: where lines go.
        interval_s: minimum time between two lines of one source.
        max_sources: sources tracked at once (beyond, they share one bucket).
        clock: monotonic clock (injectable for tests).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, max_sources: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval = interval_s
        self._max = max_sources
        self._clock = clock
        self._lock = threading.Lock()
        self._sources: Dict[str, Tuple[float, int]] = {}  # source -> (last line time, suppressed since)
        self.events = 0  # every event, logged or not

    def warning(self, source: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` for ``source`` unless it logged within the interval; True if logged."""
        now = self._clock()
        with self._lock:
            self.events += 1
            if source not in self._sources and len(self._sources) >= self._max:
                self._sources = {k: v for k, v in self._sources.items() if now - v[0] < self._interval}
                if len(self._sources) >= self._max:
                    source = "(other sources)"
            last, suppressed = self._sources.get(source, (None, 0))
            if last is not None and now - last < self._interval:
                self._sources[source] = (last, suppressed + 1)
                return False
            self._sources[source] = (now, 0)
        note = f" ({suppressed} similar events from {source} suppressed)" if suppressed else ""
        self._logger.warning(msg + "%s", *args, note)
        return True


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
