"""Create a manager's ``mori_core.io`` engine and register its memory; SGLang's MoRI knobs.

The engine and registration helpers are shared with the other adapters
(:mod:`mori_integrations.common.engine_setup`); this module adds what is SGLang's:
the ``SGLANG_MORI_*`` / ``SGLANG_DISAGGREGATION_*`` knobs of its in-tree MoRI backend
(same names, same meaning; see each function) and where SGLang keeps its pools.
"""

from __future__ import annotations

import logging
from typing import Optional

from mori_core.io import MemoryLocationType
from mori_integrations.common.engine_setup import EngineSetup, create_engine, register_regions
from mori_integrations.common.engine_setup import RdmaTuning as _RdmaTuning

__all__ = [
    "NO_LIMIT_S",
    "EngineSetup",
    "RdmaTuning",
    "aux_rdma_note",
    "create_engine",
    "create_engine_bounded",
    "kv_location",
    "register_regions",
    "transfer_timeout_s",
]

logger = logging.getLogger(__name__)

# SGLANG_MORI_TRANSFER_TIMEOUT_MS <= 0: no SLA. A year stands for "no limit" because the
# status wait needs a finite deadline; the transport's own timeouts still end dead peers.
NO_LIMIT_S = 365 * 86400.0


class RdmaTuning(_RdmaTuning):
    """SGLang's ``SGLANG_MORI_*`` knobs (same names and meaning as its in-tree backend)."""

    @classmethod
    def from_env(cls) -> "RdmaTuning":
        """Read ``SGLANG_MORI_QP_PER_TRANSFER / _POST_BATCH_SIZE / _NUM_WORKERS`` via SGLang's envs."""
        from sglang.srt.environ import envs

        return cls(
            qp_per_transfer=envs.SGLANG_MORI_QP_PER_TRANSFER.get(),
            post_batch_size=envs.SGLANG_MORI_POST_BATCH_SIZE.get(),
            num_worker_threads=envs.SGLANG_MORI_NUM_WORKERS.get(),
        )


def transfer_timeout_s() -> float:
    """``SGLANG_MORI_TRANSFER_TIMEOUT_MS`` in seconds: a chunk's writes not done by then fail the request.

    As in stock sglang 0.5.23 (its per-transfer "SLA"), 0 -- the default -- or less means no
    limit (:data:`NO_LIMIT_S`): the wait then ends when the engine ends the transfer (its TCP
    operation timeout, RDMA retries, a dead peer).
    """
    from sglang.srt.environ import envs

    ms = envs.SGLANG_MORI_TRANSFER_TIMEOUT_MS.get()
    return ms / 1000 if ms > 0 else NO_LIMIT_S


def aux_rdma_note() -> Optional[str]:
    """Why ``SGLANG_MORI_SEND_AUX_RDMA`` set to false is not applied (None when it is unset or true).

    Stock sglang copies the metadata (aux) buffers over ZMQ unless the knob is true, in which
    case the IO engine writes them. Here the engine always writes them, in the same batch as
    the request's last KV chunk and before Success is reported (over TCP where there is no
    RDMA), so the knob's true value is what always happens and a ZMQ copy path is not offered.
    """
    from sglang.srt.environ import envs

    if not envs.SGLANG_MORI_SEND_AUX_RDMA.is_set() or envs.SGLANG_MORI_SEND_AUX_RDMA.get():
        return None
    return (
        "SGLANG_MORI_SEND_AUX_RDMA=0 is not applied: mori-suite always writes the metadata (aux) buffers "
        "through the IO engine with the request's last KV chunk, before Success is sent (TCP where there is "
        "no RDMA); the ZMQ copy path of SGLang's in-tree backend is not offered"
    )


def create_engine_bounded(key: str, host: str, *, gpu_memory: bool, rdma: _RdmaTuning,
                          ib_device: Optional[str] = None) -> EngineSetup:
    """:func:`create_engine` within ``SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT`` seconds (60), as stock does.

    Raises RuntimeError naming the knob when engine creation (listener, RDMA devices,
    backends) does not return in time; the stuck thread cannot be cancelled and ends with
    the process, which SGLang then fails to start.
    """
    from sglang.srt.environ import envs
    from sglang.srt.utils.common import run_with_deadline

    timeout_s = envs.SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT.get()
    return run_with_deadline(
        lambda: create_engine(key, host, gpu_memory=gpu_memory, ib_device=ib_device, rdma=rdma),
        timeout_s=timeout_s,
        what=f"mori-suite IO engine {key!r} on {host} (SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT={timeout_s})",
    )


def kv_location(device_type: str) -> MemoryLocationType:
    """Where SGLang's KV/state pools live for ``--device`` ``device_type`` (the pools follow it)."""
    return MemoryLocationType.CPU if device_type == "cpu" else MemoryLocationType.GPU
