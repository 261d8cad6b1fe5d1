"""``MoriSuiteConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on mori-suite's IO engine.

vLLM builds one instance per role: in the engine-core process (``SCHEDULER``,
:mod:`.scheduler`) and in every worker (``WORKER``, :mod:`.worker`); every interface
method delegates to the part of its role. Written against vLLM 0.30 (CI) and checked
against 0.31-0.33's sources.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from mori_integrations.vllm.kv_connector.config import ConnectorConfig
from mori_integrations.vllm.kv_connector.metadata import StepPlan
from mori_integrations.vllm.kv_connector.scheduler import ConnectorScheduler
from mori_integrations.vllm.kv_connector.worker import ConnectorWorker

try:  # vLLM >= 0.32 labels external cache hits by source
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - vLLM 0.30/0.31
    CacheHitSource = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["MoriSuiteConnector", "MoriSuiteConnectorMetadata"]


@dataclasses.dataclass
class MoriSuiteConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`StepPlan`, as vLLM hands it from the scheduler to the workers."""

    plan: StepPlan = dataclasses.field(default_factory=StepPlan)


class MoriSuiteConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode disaggregation over ``mori_core.io`` (XGMI / RDMA / TCP), MoRIIO-compatible config."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: Optional[ConnectorScheduler] = None
        self._worker: Optional[ConnectorWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(
                vllm_config, self.config, kv_cache_config, str(self._kv_transfer_config.engine_id)
            )
        else:
            self._worker = ConnectorWorker(vllm_config, kv_cache_config, self.config)

    # ==================================================== scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return MoriSuiteConnectorMetadata(self._scheduler.build_connector_meta(scheduler_output))

    def request_finished(self, request: "Request", block_ids: list[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._scheduler is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            self._scheduler.update_connector_output(getattr(meta, "results", None))

    # ======================================================= worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(self._plan_of(connector_metadata))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._plan_of(self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only after its KV arrived

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def build_connector_worker_meta(self):  # -> TransferResultsMeta | None
        return None if self._worker is None else self._worker.worker_meta()

    def get_kv_connector_stats(self):  # -> MoriSuiteKVStats | None
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        if data is None:
            return None
        from mori_integrations.vllm.kv_connector.prom import MoriSuiteKVStats

        return MoriSuiteKVStats(data=data)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    @staticmethod
    def _plan_of(metadata: KVConnectorMetadata) -> StepPlan:
        plan = getattr(metadata, "plan", None)
        if not isinstance(plan, StepPlan):
            raise TypeError(f"MoriSuiteConnector got {type(metadata).__name__} metadata from the scheduler")
        return plan

    # ========================================================= class-level
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer must run between graph pieces (layer-pipelined writes)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # registered KV memory must not move

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None):
        from mori_integrations.vllm.kv_connector.prom import MoriSuiteKVStats

        return MoriSuiteKVStats(data=data) if data is not None else MoriSuiteKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from mori_integrations.vllm.kv_connector.prom import MoriSuitePromMetrics

        return MoriSuitePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
