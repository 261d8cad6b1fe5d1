"""Create an adapter's ``mori_core.io`` engine and register its memory.

One engine gets the transports the machine offers (or the one the user asked for); the
engine then picks, per (local, remote) memory pair, XGMI for GPU pairs on one node, RDMA
when both engines have it, and TCP otherwise. Adapters never choose a transport per
transfer themselves.
"""

from __future__ import annotations

import dataclasses
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
    TcpBackendConfig,
    XgmiBackendConfig,
)

__all__ = ["BACKEND_CHOICES", "EngineSetup", "RdmaTuning", "create_engine", "register_regions", "try_backend"]

# "auto": every transport the machine offers; the others: exactly that transport
# (plus TCP, which also carries the engine's listener and CPU-memory pairs).
BACKEND_CHOICES = ("auto", "tcp", "xgmi", "rdma")


@dataclasses.dataclass(frozen=True)
class RdmaTuning:
    """Queue pairs per transfer, work-request batching and worker threads of the RDMA backend."""

    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = 1


@dataclasses.dataclass
class EngineSetup:
    """The engine plus what was (not) available, for the adapter's log line."""

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
    rdma: RdmaTuning,
    ib_device: Optional[str] = None,
    backend: str = "auto",
    auth_secret: str = "",
    tcp: Optional[TcpBackendConfig] = None,
    xgmi: Optional[XgmiBackendConfig] = None,
) -> EngineSetup:
    """An engine listening on ``host`` at an OS-chosen port.

    Args:
        key: unique engine name (peers address it by this key).
        host: IPv4 address the engine's listener binds and advertises.
        gpu_memory: whether the memory to move lives on a GPU (XGMI is tried only then).
        rdma: queue-pair / batching / worker tuning of the RDMA backend.
        ib_device: RDMA devices to use; exported as ``MORI_RDMA_DEVICES``.
        backend: one of :data:`BACKEND_CHOICES`. ``auto`` adds XGMI (GPU memory) and
            RDMA where they work; ``tcp`` keeps the core from adding XGMI by itself;
            ``xgmi`` / ``rdma`` raise ``RuntimeError`` when that transport cannot be made.
        auth_secret: shared secret of the engine's listener ("" = ``MORI_IO_AUTH_SECRET`` or none).
        tcp: TCP backend settings (None = the core's defaults).
        xgmi: XGMI backend settings, e.g. the copy proxy (None = the core's defaults).
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"create_engine: backend must be one of {list(BACKEND_CHOICES)}, got {backend!r}")
    if backend == "xgmi" and not gpu_memory:
        raise ValueError("backend 'xgmi' copies GPU to GPU but the memory to move is in host memory; use 'tcp' or 'auto'")
    if ib_device:
        os.environ["MORI_RDMA_DEVICES"] = ib_device
    engine = IOEngine(
        key, IOEngineConfig(host=host, port=0, auth_secret=auth_secret, enable_auto_xgmi=backend in ("auto", "xgmi"))
    )
    unavailable: Dict[str, str] = {}
    if gpu_memory and backend in ("auto", "xgmi"):
        try_backend(engine, BackendType.XGMI, xgmi or XgmiBackendConfig(), unavailable, required=backend == "xgmi")
    if backend in ("auto", "rdma"):
        rdma_config = RdmaBackendConfig(
            rdma.qp_per_transfer,
            rdma.post_batch_size,
            rdma.num_worker_threads,
            PollCqMode.POLLING,
            False,  # completion is signalled over the adapter's control plane, not by target notifications
        )
        try_backend(engine, BackendType.RDMA, rdma_config, unavailable, required=backend == "rdma")
    # TCP serves every pair the others cannot (CPU memory, hosts without RDMA).
    engine.create_backend(BackendType.TCP, tcp)
    port = engine.get_engine_desc().port
    if port <= 0:
        raise RuntimeError(f"mori_core.io engine {key!r} did not bind a port on {host}")
    backends = [str(b.name) for b in engine.backends()]
    return EngineSetup(engine=engine, backends=backends, unavailable=unavailable)


def try_backend(
    engine: IOEngine, kind: BackendType, config: object, unavailable: Dict[str, str], *, required: bool = False
) -> None:
    """Add a transport; record why it is unavailable, or raise when ``required``."""
    try:
        engine.create_backend(kind, config)
    except (RuntimeError, ValueError, LookupError) as e:
        if required:
            raise RuntimeError(f"the {kind.name} transport was requested but cannot be created here: {e}") from e
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
