"""Fixtures of the vLLM-Omni connector tests (nothing heavy is imported here:
the GPU test of this directory runs where vLLM-Omni is not installed)."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest


@pytest.fixture
def free_base_port() -> Callable[[int], int]:
    """``fn(span)`` -> a base port such that base .. base+span-1 are all free now."""
    from omni_workers import find_free_base

    return find_free_base


@pytest.fixture(scope="session")
def omni_procs() -> Iterator[list]:
    """Three long-lived stage processes shared by the tests (starting one costs ~10 s:
    vLLM-Omni imports vLLM). Tests create their own connectors in them (unique ids,
    free ports) and thaw any process they freeze."""
    from omni_workers import StageProc

    procs = [StageProc(f"omni-stage-{i}") for i in range(3)]
    try:
        for p in procs:
            p.send("pid")  # import in parallel
        for p in procs:
            p.result()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def stage_procs() -> Iterator[Callable[[str], "object"]]:
    """``spawn(name)`` -> a started :class:`omni_workers.StageProc`; all are stopped afterwards."""
    from omni_workers import StageProc

    procs: list = []

    def spawn(name: str) -> StageProc:
        p = StageProc(name)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        p.stop()
