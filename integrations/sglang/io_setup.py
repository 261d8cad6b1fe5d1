"""Create a manager's ``mori_core.io`` engine and register its memory.

Every transport the machine offers is added to one engine; the engine then picks,
per (local, remote) memory pair, XGMI for GPU pairs on one node, RDMA when both
engines have it, and TCP otherwise. The adapter never chooses a transport itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Dict, List, Optional, Sequence

from mori_core.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    XgmiBackendConfig,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RdmaTuning:
    """SGLang's ``SGLANG_MORI_*`` knobs (same names and meaning as its in-tree backend)."""

    qp_per_transfer: int
    post_batch_size: int
    num_worker_threads: int

    @classmethod
    def from_env(cls) -> "RdmaTuning":
        """Read ``SGLANG_MORI_QP_PER_TRANSFER / _POST_BATCH_SIZE / _NUM_WORKERS`` via SGLang's envs."""
        from sglang.srt.environ import envs

        return cls(
            qp_per_transfer=envs.SGLANG_MORI_QP_PER_TRANSFER.get(),
            post_batch_size=envs.SGLANG_MORI_POST_BATCH_SIZE.get(),
            num_worker_threads=envs.SGLANG_MORI_NUM_WORKERS.get(),
        )


@dataclasses.dataclass
class EngineSetup:
    """The engine plus what was (not) available, for the manager's log line."""

    engine: IOEngine
    backends: List[str]
    unavailable: Dict[str, str]

    def describe(self) -> str:
        text = "+".join(self.backends)
        if self.unavailable:
            text += " (" + "; ".join(f"{k} unavailable: {v}" for k, v in self.unavailable.items()) + ")"
        return text


def create_engine(
    key: str,
    host: str,
    *,
    gpu_memory: bool,
    ib_device: Optional[str],
    rdma: RdmaTuning,
) -> EngineSetup:
    """An engine listening on ``host`` at an OS-chosen port, with every usable backend.

    Args:
        key: unique engine name (peers address it by this key).
        host: IPv4 address the engine's listener binds and advertises.
        gpu_memory: whether the KV cache lives in GPU memory (XGMI is tried only then).
        ib_device: ``--disaggregation-ib-device``; exported as ``MORI_RDMA_DEVICES``.
        rdma: queue-pair / batching / worker tuning of the RDMA backend.
    """
    if ib_device:
        os.environ["MORI_RDMA_DEVICES"] = ib_device
    engine = IOEngine(key, IOEngineConfig(host=host, port=0))
    unavailable: Dict[str, str] = {}
    if gpu_memory:
        _try_backend(engine, BackendType.XGMI, XgmiBackendConfig(), unavailable)
    rdma_config = RdmaBackendConfig(
        rdma.qp_per_transfer,
        rdma.post_batch_size,
        rdma.num_worker_threads,
        PollCqMode.POLLING,
        False,  # completion is signalled over the control socket, not by target notifications
    )
    _try_backend(engine, BackendType.RDMA, rdma_config, unavailable)
    # TCP serves every pair the others cannot (CPU memory, hosts without RDMA).
    engine.create_backend(BackendType.TCP)
    port = engine.get_engine_desc().port
    if port <= 0:
        raise RuntimeError(f"mori_core.io engine {key!r} did not bind a port on {host}")
    backends = [str(b.name) for b in engine.backends()]
    return EngineSetup(engine=engine, backends=backends, unavailable=unavailable)


def _try_backend(engine: IOEngine, kind: BackendType, config: object, unavailable: Dict[str, str]) -> None:
    try:
        engine.create_backend(kind, config)
    except (RuntimeError, ValueError, LookupError) as e:
        unavailable[str(kind.name)] = str(e)


def register_regions(
    engine: IOEngine,
    ptrs: Sequence[int],
    lens: Sequence[int],
    location: MemoryLocationType,
    device_id: int,
) -> List[Optional[MemoryDesc]]:
    """Register each (ptr, len) region; a zero-length region keeps a ``None`` slot."""
    descs: List[Optional[MemoryDesc]] = []
    for ptr, length in zip(ptrs, lens):
        if length == 0:
            descs.append(None)
            continue
        device = device_id if location == MemoryLocationType.GPU else -1
        descs.append(engine.register_memory(int(ptr), int(length), device, location))
    return descs


def kv_location(device_type: str) -> MemoryLocationType:
    """Where SGLang's KV/state pools live for ``--device`` ``device_type`` (the pools follow it)."""
    return MemoryLocationType.CPU if device_type == "cpu" else MemoryLocationType.GPU
