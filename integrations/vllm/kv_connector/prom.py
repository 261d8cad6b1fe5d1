"""The connector's counters in vLLM's stats pipeline and on ``/metrics``.

Workers return :class:`MoriSuiteKVStats` every step (``get_kv_connector_stats``); vLLM
sums them over workers, logs them (``KV Transfer metrics: ...``) and hands them to
:class:`MoriSuitePromMetrics`, which exports

* ``vllm:mori_suite_kv_bytes_total{direction=sent|received|served}`` -- KV bytes moved
  (``sent``: written by this prefill, ``served``: read from this prefill by decodes,
  ``received``: landed in this decode),
* ``vllm:mori_suite_kv_transfers_total{result=ok|failed}`` -- requests whose KV arrived
  (or did not) on this decode,
* ``vllm:mori_suite_kv_transfer_seconds`` -- engine time per transfer (histogram).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from mori_integrations.vllm.kv_connector.stats import COUNTER_KEYS, merge_stats

__all__ = ["MoriSuiteKVStats", "MoriSuitePromMetrics"]

_DIRECTIONS = {"bytes_sent": "sent", "bytes_received": "received", "bytes_served": "served"}
_RESULTS = {"transfers_ok": "ok", "transfers_failed": "failed"}


@dataclasses.dataclass
class MoriSuiteKVStats(KVConnectorStats):
    """Counters of one or more workers since the last report (plain dict: it crosses processes)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTER_KEYS}
        self.data["transfer_ms"] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge_stats(self.data, other.data)
        return self

    def reduce(self) -> Dict[str, int | float]:
        ms: List[float] = self.data.get("transfer_ms", [])
        out: Dict[str, int | float] = {k: int(self.data.get(k, 0)) for k in COUNTER_KEYS}
        out["median_transfer_ms"] = round(statistics.median(ms), 3) if ms else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTER_KEYS) and not self.data.get("transfer_ms")


class MoriSuitePromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics of :class:`MoriSuiteKVStats` (see the module docstring)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: List[str], per_engine_labelvalues: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        values = self.per_engine_labelvalues
        by_direction = self._counter_cls(
            name="vllm:mori_suite_kv_bytes",
            documentation="KV cache bytes moved by MoriSuiteConnector (sent / received / served).",
            labelnames=labelnames + ["direction"],
        )
        self._bytes = {
            key: {idx: by_direction.labels(*lv, direction) for idx, lv in values.items()}
            for key, direction in _DIRECTIONS.items()
        }
        by_result = self._counter_cls(
            name="vllm:mori_suite_kv_transfers",
            documentation="Requests whose KV arrived through MoriSuiteConnector (ok) or did not (failed).",
            labelnames=labelnames + ["result"],
        )
        self._transfers = {
            key: {idx: by_result.labels(*lv, result) for idx, lv in values.items()} for key, result in _RESULTS.items()
        }
        self._seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:mori_suite_kv_transfer_seconds",
                documentation="Engine time of one KV transfer through MoriSuiteConnector.",
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                labelnames=labelnames,
            ),
            values,
        )

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in list(self._bytes.items()) + list(self._transfers.items()):
            value = int(transfer_stats_data.get(key, 0))
            if value:
                metric[engine_idx].inc(value)
        for ms in transfer_stats_data.get("transfer_ms", []):
            self._seconds[engine_idx].observe(ms / 1000.0)
