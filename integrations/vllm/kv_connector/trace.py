"""Per-transfer phase timestamps, for the benchmark's breakdown of where a request's time goes.

Stamps are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux), so stamps taken by the
prefill and the decode processes of one host sit on one time line. Off by default: a
disabled :meth:`PhaseTrace.mark` is one attribute test.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Dict, Tuple

__all__ = ["PhaseTrace"]


class PhaseTrace:
    """First and last stamp of each phase of each transfer id (bounded: the oldest transfers are dropped)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.enabled = False
        self._capacity = capacity
        self._lock = threading.Lock()
        self._marks: "collections.OrderedDict[str, Dict[str, Tuple[int, int]]]" = collections.OrderedDict()

    def mark(self, transfer_id: str, phase: str) -> None:
        """Stamp ``phase`` of ``transfer_id`` now (keeps the first stamp, updates the last)."""
        if not self.enabled:
            return
        now = time.perf_counter_ns()
        with self._lock:
            marks = self._marks.get(transfer_id)
            if marks is None:
                marks = self._marks[transfer_id] = {}
                while len(self._marks) > self._capacity:
                    self._marks.popitem(last=False)
            first = marks.get(phase, (now, now))[0]
            marks[phase] = (first, now)

    def take(self, transfer_id: str) -> Dict[str, Tuple[int, int]]:
        """The stamps of ``transfer_id`` (phase -> (first ns, last ns)), forgotten here."""
        with self._lock:
            return self._marks.pop(transfer_id, {})
