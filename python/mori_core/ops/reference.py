"""The reference op: :class:`~mori_core.ops.EpDispatchCombineOp`'s API over the plain-torch engine.

It is the oracle of the GPU tests and a CPU fallback: with a gloo group it runs on any machine,
with an NCCL group on GPUs. Semantics and what differs from the GPU engines (receive order,
fresh output tensors) are documented in :mod:`mori_core.ops.engines.reference`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mori_core.ops.config import EpDispatchCombineConfig
from mori_core.ops.dispatch_combine import EpDispatchCombineOp
from mori_core.ops.engines.reference import ReferenceEngine, dest_rank_mask

__all__ = ["ReferenceEpDispatchCombineOp", "dest_rank_mask"]


class ReferenceEpDispatchCombineOp(EpDispatchCombineOp):
    """Plain-torch EP dispatch/combine: the op with the reference engine. ``config``'s
    rank/world size must match ``group`` (None: the default group, or none when
    ``world_size == 1``); ``device`` is where outputs live (default: the current CUDA device for
    NCCL groups, else CPU)."""

    def __new__(cls, config: EpDispatchCombineConfig, group: Optional[dist.ProcessGroup] = None, *,
                device: Optional[torch.device] = None) -> "ReferenceEpDispatchCombineOp":
        """Always this class, whatever the kernel type (the reference serves every type)."""
        return object.__new__(cls)

    def __init__(self, config: EpDispatchCombineConfig, group: Optional[dist.ProcessGroup] = None, *,
                 device: Optional[torch.device] = None) -> None:
        config.validate()
        self.group = group
        self._bind(config, ReferenceEngine(config, group, device=device))
