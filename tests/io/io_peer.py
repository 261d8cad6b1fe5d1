"""A target engine in a separate process, driven over a pipe.

The target's registered memory lives in POSIX shared memory, so the test
process can poison it before a transfer and verify it byte for byte after,
while the data still crosses a real socket between two engines.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing import shared_memory
from typing import Any, Optional

import numpy as np

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
        elif cmd == "stop":
            pipe.send(True)
            return


class PeerProcess:
    """A target engine in a spawned process, driven by (command, argument) pairs over a pipe.

    The serve loop sends the packed EngineDesc first, then one reply per
    command; a reply that is an exception is raised here.
    """

    def __init__(self, serve: Any, args: tuple, start_timeout: float, call_timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._call_timeout = call_timeout
        self.proc = ctx.Process(target=serve, args=(child, *args), daemon=True)
        self.proc.start()
        if not self._pipe.poll(start_timeout):
            raise RuntimeError(f"target process did not start within {start_timeout} s")
        self.desc = EngineDesc.unpack(self._pipe.recv())

    def call(self, cmd: str, arg: Any = None, timeout: Optional[float] = None) -> Any:
        self._pipe.send((cmd, arg))
        if not self._pipe.poll(self._call_timeout if timeout is None else timeout):
            raise TimeoutError(f"target did not answer {cmd}")
        reply = self._pipe.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=20)
            except Exception:
                pass
        self.kill()


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
