"""Fixtures for the IO tests: an initiator engine in this process and a target in another."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from mori_core.io import BackendType, IOEngine, IOEngineConfig, MemoryLocationType, TcpBackendConfig

from peer import TargetProcess


class LocalBuffer:
    """A registered numpy buffer of the initiator."""

    def __init__(self, engine: IOEngine, size: int) -> None:
        self.array = np.zeros(size, dtype=np.uint8)
        self.desc = engine.register_memory(self.array.ctypes.data, size, -1, MemoryLocationType.CPU)


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    t = TargetProcess("target")
    yield t
    t.close()


@pytest.fixture(scope="module")
def initiator(target: TargetProcess) -> Iterator[IOEngine]:
    e = IOEngine("initiator", IOEngineConfig(host="127.0.0.1", port=0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2))
    e.register_remote_engine(target.desc)
    target.register_initiator(e)
    yield e


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
