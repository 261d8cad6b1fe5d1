"""MORI-IO: point-to-point transfer engine, API-compatible with AMD's ``mori.io``.

Quick start (two processes exchange packed descriptors out of band)::

    from mori_core.io import IOEngine, IOEngineConfig, BackendType, MemoryLocationType
    engine = IOEngine("prefill-0", IOEngineConfig(host="10.0.0.1", port=0))
    engine.create_backend(BackendType.TCP)          # works on any machine
    desc = engine.get_engine_desc().pack()          # send to the peer
    mem = engine.register_torch_tensor(kv_cache)    # send mem.pack() too
    ...
    status = engine.write(mem, 0, remote_mem, 0, nbytes, engine.allocate_transfer_uid())
    status.Wait()
"""

from mori_core._C import (
    BackendConfig,
    BackendType,
    EngineDesc,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
    TransferStatus,
    XgmiBackendConfig,
    set_log_level,
    wait_all,
)
from mori_core.io.engine import IOEngine, IOEngineSession
from mori_core.io.plan import expand_block_segments

__all__ = [
    "BackendConfig",
    "BackendType",
    "EngineDesc",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TcpBackendConfig",
    "TransferStatus",
    "XgmiBackendConfig",
    "expand_block_segments",
    "set_log_level",
    "wait_all",
]
