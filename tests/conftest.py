"""Shared pytest configuration: GPU markers skip with a reason where no GPU exists."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _gpu_count() -> int:
    try:
        import mori_core

        if not mori_core.build_info()["gpu"]:
            return 0
        from mori_core import _C

        return int(_C.gpu_device_count())
    except Exception:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = _gpu_count()
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU and a GPU build of mori_core (runs on the GPU machine via tools/gpu_check.sh)"))
        elif "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 GPUs, {n} visible (runs on the GPU machine via tools/gpu_check.sh)"))
