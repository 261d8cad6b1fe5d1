"""Scheduler side of :class:`MoriSuiteConnector` (runs in vLLM's engine-core process).

A request is a *consumer* request when its ``kv_transfer_params`` say
``do_remote_prefill`` (decode server: its prompt KV comes from a prefill server) and a
*producer* request when they say ``do_remote_decode`` (prefill server). With
``kv_role=kv_both`` one server can be either, per request.

Consumer: every prompt token not in the local prefix cache is loaded asynchronously
(the request waits in ``WAITING_FOR_REMOTE_KVS``); vLLM recomputes only the last prompt
token to sample. The worker gets a :class:`RecvJob` with the request's blocks and the
first position not covered by the local prefix cache, so cached blocks are not moved.

Producer: in the step that computes a request's last prompt chunk the workers get a
:class:`SendJob` (its blocks), so they can write layer by layer while the forward runs;
when the request finishes its blocks stay allocated (``delay_free``) until the workers
report every decode rank done (or ``defer_timeout``).

Identity: the scheduler draws a nonce at start (:attr:`ConnectorScheduler.instance_id`), hands
it to its workers with every step and returns it to the decode as ``remote_instance_id``. The
decode loads KV only from workers that name the same instance in their handshake, so a prefill
restarted on the same ports (with a fixed ``engine_id`` too) never serves its predecessor's
requests from its own blocks.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from mori_integrations.vllm.kv_connector.config import ConnectorConfig
from mori_integrations.vllm.kv_connector.metadata import FinishedSend, RecvJob, SendJob, StepPlan
from mori_integrations.vllm.kv_connector.params import (
    ParamsError,
    block_lists,
    engine_id_of,
    instance_id_of,
    mode_of,
    peer_of,
    transfer_id_of,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorScheduler", "transfer_group_ids"]

logger = logging.getLogger(__name__)


def transfer_group_ids(kv_cache_config: "KVCacheConfig") -> List[int]:
    """Indices of the KV cache groups whose blocks move between servers."""
    return [i for i, g in enumerate(kv_cache_config.kv_cache_groups) if getattr(g, "enable_kv_transfer", True)]


class ConnectorScheduler:
    """See the module docstring."""

    def __init__(
        self, vllm_config: "VllmConfig", config: ConnectorConfig, kv_cache_config: "KVCacheConfig", engine_id: str
    ) -> None:
        kv = vllm_config.kv_transfer_config
        self.config = config
        self.engine_id = engine_id
        self.instance_id = uuid.uuid4().hex  # this server process; see the module docstring
        self.is_producer = kv.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv.kv_role in ("kv_consumer", "kv_both")
        self.group_ids = transfer_group_ids(kv_cache_config)
        self.block_sizes = [int(kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size) for g in self.group_ids]
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        self.dp_rank = int(getattr(pc, "data_parallel_rank_local", None) or 0)
        self.kv_cache_manager: Optional["KVCacheManager"] = None
        self._local_computed: Dict[str, int] = {}
        self._producing: Dict[str, "Request"] = {}  # producer requests not finished yet
        self._last_chunk_sent: set = set()
        self._results: Dict[str, Dict[str, Any]] = {}  # consumer: how the KV arrived, per request
        self._plan = StepPlan(instance_id=self.instance_id)
        logger.info("MoriSuiteConnector scheduler: engine %s, instance %s", engine_id, self.instance_id)

    # ------------------------------------------------------------ helpers
    def _null_block_id(self) -> int:
        manager = self.kv_cache_manager
        pool = getattr(manager, "block_pool", None) if manager is not None else None
        null = getattr(pool, "null_block", None)
        return int(getattr(null, "block_id", 0) or 0)

    def _select(self, block_ids: Sequence[Sequence[int]]) -> List[List[int]]:
        return [list(block_ids[g]) for g in self.group_ids if g < len(block_ids)]

    # ----------------------------------------------------------- consumer
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self.is_consumer and params and params.get("do_remote_prefill")):
            return 0, False
        self._local_computed[request.request_id] = num_computed_tokens
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if self.is_producer and params.get("do_remote_decode"):
            self._producing[request.request_id] = request
            return
        if not (self.is_consumer and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        req_id = request.request_id
        computed = self._local_computed.pop(req_id, 0)
        try:
            job = self._recv_job(request, params, self._select(blocks.get_block_ids()), computed, num_external_tokens)
        except ParamsError as e:
            # The scheduler already counts these tokens as external; the worker reports the
            # request failed at once so vLLM recomputes it (or fails it, per policy).
            logger.warning("MoriSuiteConnector: request %s: bad kv_transfer_params (%s)", req_id, e)
            job = RecvJob(req_id=req_id, transfer_id=f"invalid-{req_id}", mode="invalid", peer=None,
                          local_block_ids=[], positions=[], num_prompt_tokens=request.num_prompt_tokens, error=str(e))
        self._plan.recv.append(job)

    def _recv_job(
        self, request: "Request", params: Dict[str, Any], local: List[List[int]], computed: int, num_external: int
    ) -> RecvJob:
        block_sizes = self.block_sizes[: len(local)]
        mode = "release" if num_external == 0 else mode_of(params, self.config.default_mode)
        instance = instance_id_of(params)
        remote = None
        if mode == "read":
            if params.get("remote_block_ids") is None:
                raise ParamsError("READ mode needs remote_block_ids (from the prefill's response)")
            if instance is None:  # block ids mean nothing without the process they belong to
                raise ParamsError("READ mode needs remote_instance_id (from the prefill's response; a prefill "
                                  "running an older mori-suite does not send it)")
            remote = block_lists(params["remote_block_ids"], len(local))
        return RecvJob(
            req_id=request.request_id,
            transfer_id=transfer_id_of(request.request_id, params),
            mode=mode,
            peer=peer_of(request.request_id, params),
            local_block_ids=local,
            positions=[computed // bs for bs in block_sizes],
            num_prompt_tokens=request.num_prompt_tokens,
            remote_block_ids=remote,
            null_block_id=self._null_block_id(),
            remote_engine_id=engine_id_of(params),
            remote_instance_id=instance,
        )

    # ------------------------------------------------------------ producer
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> StepPlan:
        num_scheduled = scheduler_output.num_scheduled_tokens
        for req_id, request in self._producing.items():
            if req_id in self._last_chunk_sent or req_id not in num_scheduled:
                continue
            if request.num_computed_tokens + num_scheduled[req_id] < request.num_prompt_tokens:
                continue  # an earlier chunk; the KV is written once the whole prompt is computed
            if self.kv_cache_manager is None:
                raise RuntimeError("MoriSuiteConnector: the scheduler never bound its KV cache manager")
            params = request.kv_transfer_params or {}
            try:
                tid = transfer_id_of(req_id, params)
            except ParamsError as e:
                logger.warning("MoriSuiteConnector: request %s will not hand over its KV: %s", req_id, e)
                continue
            params["transfer_id"] = tid
            self._last_chunk_sent.add(req_id)
            self._plan.send.append(
                SendJob(
                    req_id=req_id,
                    transfer_id=tid,
                    block_ids=self._select(self.kv_cache_manager.get_block_ids(req_id)),
                    num_prompt_tokens=request.num_prompt_tokens,
                    null_block_id=self._null_block_id(),
                )
            )
        plan, self._plan = self._plan, StepPlan(instance_id=self.instance_id)
        return plan

    def request_finished(self, request: "Request", block_ids: Sequence[Sequence[int]]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        params = request.kv_transfer_params
        self._local_computed.pop(req_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished before blocks were allocated (aborted while queued): let the prefill free its blocks.
            params["do_remote_prefill"] = False
            try:
                self._plan.recv.append(
                    RecvJob(req_id=req_id, transfer_id=transfer_id_of(req_id, params), mode="release",
                            peer=peer_of(req_id, params), local_block_ids=[], positions=[],
                            num_prompt_tokens=request.num_prompt_tokens,
                            remote_instance_id=instance_id_of(params))
                )
            except ParamsError:
                pass
            return False, None
        result = self._results.pop(req_id, None)
        if not params.get("do_remote_decode") or req_id not in self._producing:
            return False, result
        self._producing.pop(req_id)
        written = req_id in self._last_chunk_sent
        self._last_chunk_sent.discard(req_id)
        tid = params.get("transfer_id") or transfer_id_of(req_id, params)
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not written:  # aborted before its prompt was computed: nothing was written, blocks go now
            self._plan.finished_sends.append(FinishedSend(req_id=req_id, transfer_id=tid, aborted=True, blocks_held=False))
            return False, None
        self._plan.finished_sends.append(FinishedSend(req_id=req_id, transfer_id=tid, aborted=not ok))
        if not ok:
            return True, None  # writes may be in flight: the workers release the blocks once they ended
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": tid,
            "transfer_mode": params.get("transfer_mode", self.config.default_mode),
            "remote_block_ids": self._select(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_instance_id": self.instance_id,
            "remote_host": self.config.host_ip,
            "remote_handshake_port": self.config.handshake_port,
            "remote_notify_port": self.config.notify_port,
            "remote_dp_rank": self.dp_rank,
            "remote_tp_size": self.tp_size,
            "tp_size": self.tp_size,
        }

    def update_connector_output(self, results: Optional[Dict[str, Dict[str, Any]]]) -> None:
        """Per-request transfer outcomes reported by the workers (returned with the request's output)."""
        if results:
            self._results.update(results)
