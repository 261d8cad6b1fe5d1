"""Create a manager's ``mori_core.io`` engine and register its memory.

The engine and registration helpers are shared with the other adapters
(:mod:`mori_integrations.common.engine_setup`); this module adds what is SGLang's:
the ``SGLANG_MORI_*`` RDMA knobs and where SGLang keeps its pools.
"""

from __future__ import annotations

from mori_core.io import MemoryLocationType
from mori_integrations.common.engine_setup import EngineSetup, create_engine, register_regions
from mori_integrations.common.engine_setup import RdmaTuning as _RdmaTuning

__all__ = ["EngineSetup", "RdmaTuning", "create_engine", "kv_location", "register_regions"]


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


def kv_location(device_type: str) -> MemoryLocationType:
    """Where SGLang's KV/state pools live for ``--device`` ``device_type`` (the pools follow it)."""
    return MemoryLocationType.CPU if device_type == "cpu" else MemoryLocationType.GPU
