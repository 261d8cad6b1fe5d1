"""Transfer counters of one worker (no vLLM import; :mod:`.prom` exports them to vLLM)."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

__all__ = ["COUNTER_KEYS", "TransferCounters", "merge_stats"]

COUNTER_KEYS = ("bytes_sent", "bytes_received", "bytes_served", "transfers_ok", "transfers_failed")


class TransferCounters:
    """Thread-safe counters; :meth:`take` returns what accumulated since the last call.

    ``bytes_sent``: written into consumers (producer, WRITE); ``bytes_served``: read from
    us by consumers (producer, READ, as they report it); ``bytes_received``: KV that landed
    here (consumer, both modes); ``transfer_ms``: engine time of each finished transfer.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = self._empty()
        self.totals = {k: 0 for k in COUNTER_KEYS}

    @staticmethod
    def _empty() -> Dict[str, Any]:
        data: Dict[str, Any] = {k: 0 for k in COUNTER_KEYS}
        data["transfer_ms"] = []
        return data

    def add(self, key: str, value: int) -> None:
        with self._lock:
            self._data[key] += value
            self.totals[key] += value

    def observe_ms(self, ms: float) -> None:
        with self._lock:
            self._data["transfer_ms"].append(float(ms))

    def take(self) -> Dict[str, Any]:
        with self._lock:
            data, self._data = self._data, self._empty()
        return data


def merge_stats(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """Sum two ``take()`` snapshots (e.g. of several TP workers)."""
    out: Dict[str, Any] = {k: int(a.get(k, 0)) + int(b.get(k, 0)) for k in COUNTER_KEYS}
    ms: List[float] = list(a.get("transfer_ms", [])) + list(b.get("transfer_ms", []))
    out["transfer_ms"] = ms
    return out
