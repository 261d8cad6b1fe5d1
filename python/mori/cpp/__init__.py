"""Alias of the compiled module, as MORI's ``mori.cpp`` (e.g. ``TransferStatus``).

In builds with the EP kernel profiler (``MORI_ENABLE_PROFILER``) it also has MORI's
``get_debug_time_buf(handle)``; like MORI's, it is absent otherwise (``hasattr`` tells).
"""

from typing import Any

from mori_core._C import *  # noqa: F401,F403
from mori_core._C import TransferStatus  # noqa: F401
from mori_core._C import build_info as _build_info

if _build_info().get("profiler"):

    def get_debug_time_buf(handle: Any) -> Any:
        """int64 torch tensor viewing the profiler event buffer of an EP op handle (``op._handle``)."""
        import torch

        from mori_core import shmem
        from mori_core.ops.engines.gpu_common import byte_view

        ptr, nbytes = handle.debug_time_buf()
        return byte_view(ptr, nbytes, torch.device("cuda", shmem.shmem_device())).view(torch.int64)
