"""mori_core: portable GPU communication for LLM inference.

Areas (imported lazily so ``import mori_core`` stays cheap and torch-free):

* :mod:`mori_core.io`    — MORI-IO transfer engine (TCP, intra-node GPU, RDMA backends)
* :mod:`mori_core.shmem` — symmetric memory across the GPUs of a node
* :mod:`mori_core.ops`   — MORI-EP dispatch/combine
* :mod:`mori_core.ccl`   — MORI-CCL collectives (copy engines and SM kernels)
* :mod:`mori_core.bench` — benchmark CLI (``python -m mori_core.bench``)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["io", "shmem", "ops", "ccl", "bench", "build_info", "__version__"]

_SUBMODULES = {"io", "shmem", "ops", "ccl", "bench"}


def build_info() -> dict[str, Any]:
    """Describe this build: ``gpu`` (bool), ``gpu_lang`` ("CUDA", "HIP" or ""),
    ``cuda_arch``, which optional areas (``shmem``, ``ops``) were compiled, and ``internode``:
    whether the inter-node EP extension (``mori_core._internode``, needs NVSHMEM) was built."""
    import importlib.util

    from mori_core import _C

    info = dict(_C.build_info())
    info["internode"] = importlib.util.find_spec("mori_core._internode") is not None
    return info


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"mori_core.{name}")
    raise AttributeError(f"module 'mori_core' has no attribute {name!r}")
