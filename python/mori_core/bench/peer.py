"""A target engine in a separate process, driven over a pipe (tests and the chaos harness).

The target's registered memory lives in POSIX shared memory, so the driving
process can poison it before a transfer and verify it byte for byte after,
while the data still crosses a real socket between two engines. ``stats``
reports the process's RSS, open descriptors and threads (leak checks).
"""

from __future__ import annotations

import os
from multiprocessing import shared_memory
from typing import Any, Optional

import numpy as np

from mori_core.bench.spawned import SpawnedProcess
from mori_core.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    TcpBackendConfig,
)


def _serve(pipe, key: str, secret: str, tcp_kwargs: dict) -> None:
    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0, auth_secret=secret))
    engine.create_backend(BackendType.TCP, TcpBackendConfig(**tcp_kwargs))
    regions: dict[int, tuple[shared_memory.SharedMemory, MemoryDesc]] = {}
    pipe.send(engine.get_engine_desc().pack())
    while True:
        cmd, arg = pipe.recv()
        if cmd == "register":
            shm = shared_memory.SharedMemory(name=arg)
            import ctypes

            addr = ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))
            md = engine.register_memory(addr, shm.size, -1, MemoryLocationType.CPU)
            regions[md.id] = (shm, md)
            pipe.send(md.pack())
        elif cmd == "deregister":
            engine.deregister_memory(regions[arg][1])
            pipe.send(True)
        elif cmd == "remote":
            engine.register_remote_engine(EngineDesc.unpack(arg))
            pipe.send(True)
        elif cmd == "pop":
            st = engine.pop_inbound_transfer_status(arg[0], arg[1])
            pipe.send(None if st is None else int(st.Code()))
        elif cmd == "engine_call":  # run a transfer from the target side
            name, args = arg
            pipe.send(getattr(engine, name)(*args))
        elif cmd == "stats":
            pipe.send(process_stats(os.getpid()))
        elif cmd == "stop":
            pipe.send(True)
            return


def process_stats(pid: int) -> dict[str, int]:
    """RSS (bytes), open file descriptors and threads of process ``pid`` (Linux /proc)."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": len(os.listdir(f"/proc/{pid}/task"))}


class PeerProcess(SpawnedProcess):
    """A target engine in a spawned process; the serve loop's hello is its packed EngineDesc."""

    def __init__(self, serve: Any, args: tuple, start_timeout: float, call_timeout: float) -> None:
        super().__init__(serve, args, start_timeout, call_timeout)
        self.desc = EngineDesc.unpack(self.hello)


class TargetProcess(PeerProcess):
    """A CPU target engine; ``region(size)`` gives a shared, registered buffer."""

    def __init__(self, key: str = "target", secret: str = "", **tcp_kwargs: Any) -> None:
        super().__init__(_serve, (key, secret, tcp_kwargs), start_timeout=60, call_timeout=30)
        self._shms: list[shared_memory.SharedMemory] = []

    def region(self, size: int) -> tuple[memoryview, MemoryDesc]:
        shm = shared_memory.SharedMemory(create=True, size=size)
        self._shms.append(shm)
        md = MemoryDesc.unpack(self.call("register", shm.name))
        return shm.buf, md

    def register_initiator(self, engine: IOEngine) -> None:
        self.call("remote", engine.get_engine_desc().pack())

    def pop(self, initiator_key: str, uid: int) -> Optional[int]:
        return self.call("pop", (initiator_key, uid))

    def stats(self) -> dict[str, int]:
        """RSS, descriptors and threads of the target process."""
        return self.call("stats")

    def close(self) -> None:
        super().close()
        for shm in self._shms:
            shm.close()
            shm.unlink()


class LocalBuffer:
    """A registered numpy buffer of the initiator."""

    def __init__(self, engine: IOEngine, size: int) -> None:
        self.array = np.zeros(size, dtype=np.uint8)
        self.desc = engine.register_memory(self.array.ctypes.data, size, -1, MemoryLocationType.CPU)
