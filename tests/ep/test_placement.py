"""Rank placement (MORI_RANKS_PER_GPU): which GPU each rank of a multi-rank job uses."""

from __future__ import annotations

import pytest

from mori_core.placement import RANKS_PER_GPU_ENV, Placement, placement


@pytest.mark.parametrize(
    "world,visible,env,gpus,per_gpu",
    [
        (2, 2, "auto", 2, 1),  # enough GPUs: one rank each
        (8, 1, "auto", 1, 8),  # one GPU: everyone shares it
        (8, 4, "auto", 4, 2),
        (4, 8, "auto", 4, 1),  # never more GPUs than ranks
        (8, 4, "4", 2, 4),  # forced sharing on a multi-GPU machine
        (3, 2, "2", 2, 2),
    ],
)
def test_placement(monkeypatch, world, visible, env, gpus, per_gpu) -> None:
    monkeypatch.setenv(RANKS_PER_GPU_ENV, env)
    p = placement(world, visible=visible)
    assert (p.num_gpus, p.ranks_per_gpu, p.shared) == (gpus, per_gpu, per_gpu > 1)
    devices = [p.device_index(r) for r in range(world)]
    assert devices == [r % gpus for r in range(world)]  # round-robin
    assert max(devices.count(d) for d in set(devices)) == per_gpu


def test_placement_errors(monkeypatch) -> None:
    monkeypatch.setenv(RANKS_PER_GPU_ENV, "1")
    with pytest.raises(ValueError, match=r"MORI_RANKS_PER_GPU=1 places 4 ranks on 4 GPUs, but only 1"):
        placement(4, visible=1)
    monkeypatch.setenv(RANKS_PER_GPU_ENV, "zero")
    with pytest.raises(ValueError, match="'auto' or a positive int"):
        placement(2, visible=2)
    monkeypatch.delenv(RANKS_PER_GPU_ENV)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        placement(2, visible=0)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world=2\)"):
        Placement(2, 1).device_index(2)


def test_heap_size_unshared_is_requested() -> None:
    assert Placement(4, 4).heap_size("6G") == str(6 << 30)
