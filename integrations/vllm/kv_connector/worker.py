"""Worker side of :class:`MoriSuiteConnector`: vLLM's worker hooks -> :class:`TransferAgent`.

Runs in every vLLM worker process. It reads its ranks and the KV cache shape from
vLLM's config, builds the agent when vLLM registers the KV caches, and translates each
step's :class:`StepPlan` and vLLM's per-layer / per-step calls into agent events.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from mori_integrations.vllm.kv_connector.agent import AgentIdentity, TransferAgent
from mori_integrations.vllm.kv_connector.config import ConnectorConfig
from mori_integrations.vllm.kv_connector.consumer import RecvResult
from mori_integrations.vllm.kv_connector.metadata import StepPlan
from mori_integrations.vllm.kv_connector.scheduler import transfer_group_ids

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["ConnectorWorker", "TransferResultsMeta"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TransferResultsMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: how each finished request's KV arrived (summed over TP ranks)."""

    results: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        for req_id, r in getattr(other, "results", {}).items():
            mine = self.results.get(req_id)
            if mine is None:
                self.results[req_id] = dict(r)
                continue
            mine["kv_bytes"] += r["kv_bytes"]
            mine["kv_transfer_ok"] = mine["kv_transfer_ok"] and r["kv_transfer_ok"]
            if "kv_error" in r:
                mine.setdefault("kv_error", r["kv_error"])
            for key in ("kv_transfer_ms", "kv_wait_ms"):
                mine[key] = max(mine[key], r[key])
        return self


def _result_dict(r: RecvResult) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "kv_transfer_ok": r.ok,
        "kv_transfer_mode": r.mode,
        "kv_bytes": r.nbytes,
        "kv_transfer_ms": round(r.transfer_ms, 3),
        "kv_wait_ms": round(r.wait_ms, 3),
    }
    if not r.ok:
        out["kv_error"] = r.reason[:500]
    return out


def identity_from(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> AgentIdentity:
    """This worker's ranks and KV shape, read from vLLM."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    model = vllm_config.model_config
    pc = vllm_config.parallel_config
    mla = bool(getattr(model, "use_mla", False))
    return AgentIdentity(
        engine_id=str(vllm_config.kv_transfer_config.engine_id),
        tp_rank=get_tensor_model_parallel_rank(),
        tp_size=get_tensor_model_parallel_world_size(),
        dp_rank=int(getattr(pc, "data_parallel_rank_local", None) or 0),
        total_kv_heads=1 if mla else int(model.get_total_num_kv_heads()),
        replicated_heads=mla,
        group_block_sizes=[
            int(kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size) for g in transfer_group_ids(kv_cache_config)
        ],
        role="D" if vllm_config.kv_transfer_config.kv_role == "kv_consumer" else "P",
        dp_size=int(pc.data_parallel_size),
    )


def layer_groups_of(kv_cache_config: "KVCacheConfig") -> Dict[str, int]:
    """Layer name -> index among the transferable groups; refuses groups that are not attention KV."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    out: Dict[str, int] = {}
    for index, g in enumerate(transfer_group_ids(kv_cache_config)):
        group = kv_cache_config.kv_cache_groups[g]
        spec = group.kv_cache_spec
        specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]
        if not all(isinstance(s, AttentionSpec) for s in specs):
            raise NotImplementedError(
                f"MoriSuiteConnector moves attention KV caches only; KV cache group {g} is "
                f"{type(spec).__name__} (Mamba / linear-attention state transfer is not supported)"
            )
        for name in group.layer_names:
            out[name] = index
    return out


class ConnectorWorker:
    """See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", config: ConnectorConfig) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._config = config
        self.agent: Optional[TransferAgent] = None
        self._any_kv: Optional["torch.Tensor"] = None
        self._results: List[RecvResult] = []

    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        if self.agent is not None:
            return
        kcc = self._kv_cache_config
        self.agent = TransferAgent(
            self._config, identity_from(self._vllm_config, kcc), kv_caches, layer_groups_of(kcc), kcc.num_blocks
        )
        self._any_kv = next(iter(kv_caches.values()), None)

    def _require_agent(self) -> TransferAgent:
        if self.agent is None:
            raise RuntimeError("MoriSuiteConnector: KV caches were never registered with the connector")
        return self.agent

    # -------------------------------------------------------------- steps
    def bind(self, plan: StepPlan) -> None:
        """Before the forward: producer jobs of this step (writes can start layer by layer)."""
        if self.agent is not None:
            self.agent.bind_instance(plan.instance_id)
        if plan.send or plan.finished_sends:
            self._require_agent().producer.begin_step(plan.send, plan.finished_sends)

    def start_load(self, plan: StepPlan) -> None:
        if plan.recv:
            self._require_agent().consumer.start(plan.recv)

    def save_layer(self, layer_name: str, kv_layer: "torch.Tensor") -> None:
        if self.agent is not None:
            self.agent.producer.on_layer_saved(layer_name, kv_layer)

    def end_step(self) -> None:
        if self.agent is not None:
            self.agent.producer.end_step(self._any_kv)

    def transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.agent is None:
            return out
        self.agent.consumer.abort(set(finished_req_ids))
        results = self.agent.consumer.take_results()
        self._results.extend(results)
        out.finished_sending = self.agent.producer.take_finished()
        out.finished_recving = {r.req_id for r in results}
        out.failed_recving = {r.req_id for r in results if not r.ok and not r.aborted}
        return out

    def worker_meta(self) -> Optional[TransferResultsMeta]:
        if not self._results:
            return None
        meta = TransferResultsMeta({r.req_id: _result_dict(r) for r in self._results})
        self._results = []
        return meta

    def take_stats(self) -> Optional[Dict[str, Any]]:
        if self.agent is None:
            return None
        data = self.agent.counters.take()
        return data if any(data.values()) else None

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
