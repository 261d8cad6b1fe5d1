"""EPv2 rows of the IntraNode EP benchmark: ``python -m mori_core.bench ep --v2``.

Next to the v1 rows of the same run, per token count: the EPv2 op
(``mori.ops.dispatch_combine_v2``, over a ``mori.cco.Communicator`` on the already-initialised
heap) timed the way SGLang's EPv2 dispatcher calls it -- ``dispatch(..., return_routing=True,
recv_cap=<full>, clone_routing=False)`` and ``combine(input, None, recv_ids, routing=h)`` -- for
the gather (pull) and scatter (push) combine modes, bf16. The kernels are the v1 engine's, so the
difference to the v1 rows is the v2 face's host work (the "host us/call" column) and the schedule
it picks (blocks x warps).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The option that turns the v2 rows on."""
    p.add_argument("--v2", action="store_true", help="also time the EPv2 API (mori.ops.dispatch_combine_v2)")


def make_ops(cfg: Any, args: argparse.Namespace) -> Optional[dict]:
    """Collective: the v2 ops (gather, scatter) of the v1 op's shape, or None without ``--v2``.
    Call after the v1 op is built, on every rank."""
    if not getattr(args, "v2", False):
        return None
    import torch
    import torch.distributed as dist

    from mori_core.cco import Communicator
    from mori_core.ops.dispatch_combine_v2 import EpDispatchCombineConfig, EpDispatchCombineOp

    uid = [Communicator.get_unique_id() if cfg.rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    comm = Communicator.init(cfg.world_size, cfg.rank, uid[0])  # joins the heap the v1 op uses
    ops = {"comm": comm}
    for mode in ("gather", "scatter"):
        v2cfg = EpDispatchCombineConfig(
            rank=cfg.rank, world_size=cfg.world_size, hidden_dim=cfg.hidden_dim,
            max_num_inp_token_per_rank=cfg.max_num_inp_token_per_rank, num_experts_per_rank=cfg.num_experts_per_rank,
            num_experts_per_token=cfg.num_experts_per_token, data_type=torch.bfloat16, combine_mode=mode,
        )
        ops[mode] = EpDispatchCombineOp(v2cfg, comm)
    comm.barrier()
    return ops


def rows(ops: Optional[dict], args: argparse.Namespace, n: int, x: Any, w: Any, idx: Any,
         measure: Callable[..., dict], sync: Callable) -> list[dict]:
    """v2 dispatch and combine rows for ``n`` tokens per rank (collective); [] without ``--v2``."""
    if not ops:
        return []
    import torch

    out: list[dict] = []
    for mode in ("gather", "scatter"):
        op = ops[mode]
        cap = op.cfg.effective_max_recv
        db, dw, cb, cw = op.cfg.launch_for(n)

        def dispatch() -> tuple:
            return op.dispatch(x, w, None, idx, return_routing=True, recv_cap=cap, clone_routing=False)

        recv_x, _, _, recv_ids, total, handle = dispatch()
        torch.cuda.synchronize()
        recv = int(total[0])
        if mode == "gather":
            out.append(measure(dispatch, args, sync, kernel="v2 dispatch", dtype="bf16", tokens=n, recv=recv,
                               bytes=recv * x.shape[1] * x.element_size(), blocks=db, warps=dw, mode="-"))
            recv_x, _, _, recv_ids, total, handle = dispatch()
        expert_out = op.combine_in_view()[: recv_x.shape[0]]
        expert_out.copy_(recv_x)  # identity experts, written where SGLang's runner writes them
        combine = lambda: op.combine(expert_out, None, recv_ids, routing=handle)  # noqa: E731
        out.append(measure(combine, args, sync, kernel="v2 combine", dtype="bf16", tokens=n, recv=recv,
                           bytes=recv * x.shape[1] * 2, blocks=cb, warps=cw,
                           mode="pull" if mode == "gather" else "push"))
    return out


def close(ops: Optional[dict]) -> None:
    """Collective: free the v2 ops (before the v1 op and the heap go)."""
    if not ops:
        return
    for mode in ("gather", "scatter"):
        ops[mode].close()
    ops["comm"].destroy()  # the heap belongs to the benchmark's shmem init, so it stays
