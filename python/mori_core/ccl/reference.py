"""The CPU reference of MORI-CCL: the same collectives over a torch.distributed process group
(gloo), for machines without a GPU. It defines the semantics the GPU engines match:

* all-gather: rank r's ``count`` input elements land at ``output[r*count:(r+1)*count]``;
* all-to-all: chunk p of rank r's input (``count`` elements) lands in chunk r of rank p's output;
* all-reduce: the sum over ranks taken in rank order, floats accumulated in fp32 and rounded
  once to the dtype, integers modulo 2**32 -- the GPU engines add in the same order, so every
  engine and every rank gives the same bits.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

# torch >= 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rank_order_sum(parts: torch.Tensor) -> torch.Tensor:
    """Sum of ``parts`` ([npes, n]) over dim 0 in rank order, as the GPU engines compute it."""
    dtype = parts.dtype
    if dtype in (torch.int32, torch.uint32):
        acc = parts.view(torch.int32).to(torch.int64).sum(dim=0)  # exact; then wrap to 32 bits
        acc = acc & 0xFFFFFFFF
        acc = torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)
        return acc.view(dtype)
    acc = parts[0].to(torch.float32)
    for p in range(1, parts.shape[0]):
        acc = acc + parts[p].to(torch.float32)
    return acc.to(dtype)


class ReferenceBackend:
    """One handle's collectives over the default process group (CPU tensors)."""

    device = torch.device("cpu")
    path_names = ["reference"]
    heap_bytes = 0
    ce_available = False

    def __init__(self, kind: str, my_pe: int, npes: int) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "mori.ccl without a GPU runs its CPU reference over torch.distributed: call "
                "torch.distributed.init_process_group('gloo', ...) first"
            )
        if (dist.get_rank(), dist.get_world_size()) != (my_pe, npes):
            raise ValueError(
                f"my_pe/npes ({my_pe}/{npes}) differ from the process group's "
                f"({dist.get_rank()}/{dist.get_world_size()})"
            )
        self.kind, self.rank, self.npes = kind, my_pe, npes
        self._finish: Optional[Callable[[], None]] = None

    def start(self, inp: torch.Tensor, out: torch.Tensor, count: int) -> None:
        """Launch the collective (async gloo work); :meth:`finish` completes it."""
        n = self.npes
        if count == 0:
            self._finish = lambda: None
            return
        if self.kind == "allgather":
            src = inp.reshape(-1)[:count].view(torch.uint8)
            dst = torch.empty(n * src.numel(), dtype=torch.uint8)
            work = _ALL_GATHER(dst, src, async_op=True)
            target = out.reshape(-1)[: n * count]

            def done() -> None:
                work.wait()
                target.view(torch.uint8).copy_(dst)

        elif self.kind == "all2all":
            src = inp.reshape(-1)[: n * count].view(torch.uint8).clone()
            dst = torch.empty_like(src)
            work = dist.all_to_all_single(dst, src, async_op=True)
            target = out.reshape(-1)[: n * count]

            def done() -> None:
                work.wait()
                target.view(torch.uint8).copy_(dst)

        else:
            src = inp.reshape(-1)[:count]
            gathered = torch.empty(n * count, dtype=src.dtype)
            work = _ALL_GATHER(gathered.view(torch.uint8), src.view(torch.uint8), async_op=True)
            target = out.reshape(-1)[:count]

            def done() -> None:
                work.wait()
                target.copy_(rank_order_sum(gathered.view(n, count)))

        self._finish = done

    def finish(self) -> None:
        done, self._finish = self._finish, None
        if done is not None:
            done()

    def run(self, inp: torch.Tensor, out: torch.Tensor, count: int) -> None:
        self.start(inp, out, count)
        self.finish()

    def choose(self, nbytes: int) -> str:
        return "reference"

    def error(self) -> str:
        return ""

    def reset_flags(self) -> None:
        self.finish()

    def close(self) -> None:
        self._finish = None

