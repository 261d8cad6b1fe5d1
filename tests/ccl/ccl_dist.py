"""What the CCL tests share: the bounded multi-process runner of the EP tests, deterministic
per-rank inputs, and the oracles (torch.distributed, and the rank-order sum every engine
computes)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# The EP tests' runner: spawns N ranks, bounds the run, reports every failing rank's traceback.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ep"))
from ep_dist_utils import run_ranks  # noqa: E402,F401 - re-exported to the CCL tests

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT_DTYPES = (torch.int32, torch.uint32)


def rank_input(seed: int, rank: int, n: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """``n`` deterministic values of ``dtype`` for ``rank`` (every rank can rebuild every other
    rank's input). Integers span the full 32-bit range, so sums wrap."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype in INT_DTYPES:
        x = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
        return x.view(dtype).to(device)
    return torch.randn(n, generator=g).to(dtype).to(device)


def rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """The all-reduce every engine computes, written independently of the library: floats
    added in fp32 in rank order from rank 0's value and rounded once; integers mod 2**32."""
    dtype = xs[0].dtype
    if dtype in INT_DTYPES:
        acc = torch.zeros(xs[0].numel(), dtype=torch.int64)
        for x in xs:
            acc = (acc + x.cpu().view(torch.int32).to(torch.int64)) % (2**32)
        return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32).view(dtype)
    acc = xs[0].cpu().float()
    for x in xs[1:]:
        acc = acc + x.cpu().float()
    return acc.to(dtype)


def close_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, npes: int) -> bool:
    """``a`` within rounding of ``b`` (NCCL / gloo round at every step, we once). Compared on
    ``a``'s device: a 256 MiB comparison on the CPU takes seconds (the GPU suite's budget)."""
    b = b.to(a.device)
    if dtype in INT_DTYPES:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype] * npes
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def init_shmem_rank(rank: int, world: int) -> torch.device:
    """In a GPU rank (process group already up): register it as "default", initialise mori
    shmem over it; returns the rank's device."""
    import torch.distributed as dist

    import mori_core.shmem as shmem

    torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
    shmem.shmem_torch_process_group_init("default")
    return torch.device("cuda", torch.cuda.current_device())
