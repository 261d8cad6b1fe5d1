"""Fixtures for the IO tests: an initiator engine in this process and a target in another."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from mori_core.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig

from io_peer import TargetProcess


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
