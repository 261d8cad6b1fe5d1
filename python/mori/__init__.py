"""``mori`` compatibility alias provided by mori-suite.

Code written for AMD's MORI (``import mori``, ``from mori.io import IOEngine``,
``from mori.cpp import TransferStatus``, ``mori.ops`` (and ``mori.ops.dispatch_combine_v2``),
``mori.shmem``, ``mori.cco``, ``mori.ccl``,
``mori.kernel_profiler``) runs on
mori_core. This package is installed in its own folder that is appended to
``sys.path`` by ``mori_suite_alias.pth``: an installed ``amd-mori`` therefore
always takes precedence and is never overwritten.
"""

from __future__ import annotations

import importlib
from typing import Any

__mori_suite__ = True  # marks the alias (AMD's package lacks this attribute)
_SUBMODULES = {"io", "cpp", "ops", "shmem", "kernel_profiler", "cco", "ccl"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"mori.{name}")
    raise AttributeError(f"module 'mori' has no attribute {name!r}")
