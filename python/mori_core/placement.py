"""Where the ranks of a multi-process GPU job run: one GPU per rank, or several ranks per GPU.

The multi-rank GPU tests, the GPU benchmarks and the ``tools/gpu`` scripts place their ranks
through this module, so one switch decides it everywhere:

``MORI_RANKS_PER_GPU``
    ``auto`` (default): one rank per GPU while there are enough GPUs; with fewer GPUs than
    ranks, the ranks share them round-robin (rank ``r`` on GPU ``r % num_gpus``).
    ``N`` (a positive int): place at most N ranks on each GPU, using ``ceil(world / N)`` GPUs
    (must not exceed the visible count). ``N=1`` insists on one GPU per rank.

Ranks that share a GPU are separate processes: the symmetric heap maps peers through CUDA IPC
to the same device and the driver time-slices their kernels. That runs the real cross-rank
logic (other processes, IPC mappings, flags and counters written by another rank), but *timings
mean nothing* there; only correctness and host-side figures carry over.

NCCL refuses two ranks of one communicator on one GPU, so a shared placement uses gloo for the
process group (the EP reference op and the shmem bootstrap both work over gloo).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["RANKS_PER_GPU_ENV", "Placement", "placement", "init_rank_process_group"]

RANKS_PER_GPU_ENV = "MORI_RANKS_PER_GPU"
_HEAP_ALIGN = 2 << 20  # the heap must be a multiple of 2 MiB
# Share of a GPU's memory the symmetric heaps of the ranks on it may take together: the rest is
# left for each process's CUDA context, test tensors and the reference op.
_HEAP_SHARE = 0.5


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _parse_ranks_per_gpu(raw: str) -> Optional[int]:
    """None for ``auto``; a positive int otherwise. Raises ValueError naming the variable."""
    value = raw.strip().lower()
    if value in ("", "auto"):
        return None
    n = int(value) if value.isdigit() else 0  # one message for "x", "-2" and "0"
    if n < 1:
        raise ValueError(f"{RANKS_PER_GPU_ENV}={raw!r} must be 'auto' or a positive int")
    return n


@dataclass(frozen=True)
class Placement:
    """The GPUs a job of ``world`` ranks uses and which rank runs on which."""

    world: int
    num_gpus: int  # GPUs used (<= visible)

    @property
    def ranks_per_gpu(self) -> int:
        """The most ranks any one GPU carries."""
        return math.ceil(self.world / self.num_gpus)

    @property
    def shared(self) -> bool:
        """True when some GPU carries more than one rank (timings are then not meaningful)."""
        return self.ranks_per_gpu > 1

    def device_index(self, rank: int) -> int:
        """CUDA device of ``rank`` (round-robin over the GPUs used)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} must be in [0, world={self.world})")
        return rank % self.num_gpus

    def heap_size(self, requested: str | int) -> str:
        """``MORI_SHMEM_HEAP_SIZE`` for each rank: ``requested`` (bytes or a string like "6G")
        when every rank has its own GPU, otherwise scaled down so the heaps of the ranks on one
        GPU take at most half of its memory (8 ranks then fit on one 80 GB GPU)."""
        want = _parse_size(requested)
        if not self.shared:
            return str(want)
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        cap = int(total * _HEAP_SHARE) // self.ranks_per_gpu // _HEAP_ALIGN * _HEAP_ALIGN
        return str(max(_HEAP_ALIGN, min(want, cap)))

    def describe(self) -> str:
        """One line for logs and table headers."""
        if not self.shared:
            return f"{self.world} rank(s), one per GPU"
        return (
            f"{self.world} ranks sharing {self.num_gpus} GPU(s) ({self.ranks_per_gpu} per GPU): "
            "kernel timings not meaningful"
        )


def _parse_size(value: str | int) -> int:
    if isinstance(value, int):
        return value
    s = value.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    digits = s[:-1] if s[-1:] in "KMG" else s
    try:
        return int(float(digits) * mult)
    except ValueError:
        raise ValueError(f"heap size {value!r} must be bytes or a number with K/M/G") from None


def placement(world: int, visible: Optional[int] = None) -> Placement:
    """Placement of ``world`` ranks on the ``visible`` GPUs (default: what torch sees) under
    ``MORI_RANKS_PER_GPU``. Raises ValueError when no GPU is visible or N ranks per GPU would
    need more GPUs than are visible."""
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    gpus = _visible_gpus() if visible is None else visible
    if gpus < 1:
        raise ValueError("no CUDA GPU is visible")
    per_gpu = _parse_ranks_per_gpu(os.environ.get(RANKS_PER_GPU_ENV, "auto"))
    if per_gpu is None:
        return Placement(world, min(world, gpus))
    need = math.ceil(world / per_gpu)
    if need > gpus:
        raise ValueError(
            f"{RANKS_PER_GPU_ENV}={per_gpu} places {world} ranks on {need} GPUs, but only {gpus} are visible"
        )
    return Placement(world, need)


def init_rank_process_group(rank: int, world: int, init_method: str, use_nccl: bool = True) -> "object":
    """In a rank process: select its GPU and join the default process group; returns the
    ``torch.device``. Uses ``cpu:gloo,cuda:nccl`` (NCCL bound to the device) when every rank has
    its own GPU and ``use_nccl``, plain gloo otherwise (NCCL refuses ranks sharing a GPU)."""
    import torch
    import torch.distributed as dist

    where = placement(world)
    dev = torch.device("cuda", where.device_index(rank))
    torch.cuda.set_device(dev)
    if use_nccl and not where.shared:
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method=init_method, rank=rank, world_size=world, device_id=dev
        )
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    return dev
