"""Launch-knob sweep of the IntraNode kernels: ``python -m mori_core.bench ep --tune``.

What a second run needs to fill the AUTO launch table (``mori_core/ops/launch_config.py``) and
the combine-kernel choice (``launch_config.combine_mode``), per token count of ``--tune-tokens``
(default: every ``--tokens`` value), timed with DeepEP's ``bench()`` method in quick form:

* **grids**: dispatch (BF16, FP8 + scales) and every combine kernel a call can run -- a push call
  on the push kernel and on copy-pull, a pull call on the pull kernel and on the push kernel, and
  the FP8 direct-cast combine of a push call -- over ``TUNE_BLOCKS`` x ``TUNE_WARPS``;
* **staged push**: ``MORI_EP_PUSH_STAGE_TOKENS`` x ``MORI_EP_PUSH_REDUCE_BLOCKS`` at the op's
  grid (BF16 push call and FP8 direct cast), at the largest token count;
* **overlapped push**: ``MORI_EP_PUSH_OVERLAP`` 0 (push, barrier, reduce) against 1 (reduce while
  the rows arrive) x ``MORI_EP_PUSH_OVERLAP_REDUCE_BLOCKS``, same calls, at every swept token count
  (``--tune-push`` runs only this sweep: a quick A/B).

Variants that are read when an op is built (the combine kernel, the staging) get an op of their
own (collective: every rank builds and closes the same ops in the same order).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator

from mori_core.bench.ep.measure import bench_like_deepep

TUNE_BLOCKS = (32, 64, 96, 132, 264)
TUNE_WARPS = (4, 8, 16)
STAGE_TOKENS = (0, 256, 512, 1024)
REDUCE_BLOCKS = (-1, 8, 33, 66)  # -1: the kernel's default (a quarter of the grid)
OVERLAP_REDUCE_BLOCKS = (-1, 0, 33, 88)  # -1: half the grid; 0 (the default): every block, after pushing
QUICK = (3, 10)  # (warm-up, timed) calls per point


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the sweep."""
    p.add_argument("--tune", action="store_true",
                   help="sweep launch grids, combine kernels and push staging (quick timing) for the launch table")
    p.add_argument("--tune-tokens", default="", help="token counts to sweep (default: every --tokens value)")
    p.add_argument("--tune-push", action="store_true",
                   help="with --tune: only the overlapped-push sweep (MORI_EP_PUSH_OVERLAP 0 against 1 x reducer blocks)")


@contextlib.contextmanager
def variant_op(cfg: Any, env: dict[str, str], sync: Callable[[], None]) -> Iterator[Any]:
    """An op built with ``env`` set (read at construction), closed on leaving (collective)."""
    from mori_core.ops import EpDispatchCombineOp

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        op = EpDispatchCombineOp(cfg)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield op
    finally:
        sync()
        op.close()


def rows(op: Any, cfg: Any, args: argparse.Namespace, n: int, inputs: dict, sync: Callable[[], None]) -> list[dict]:
    """The sweep rows of ``n`` tokens per rank (collective); [] unless ``--tune`` selects ``n``."""
    if not getattr(args, "tune", False):
        return []
    wanted = [int(t) for t in (args.tune_tokens or args.tokens).split(",") if t.strip()]
    if n not in wanted:
        return []
    import torch

    x, w, idx = inputs["x"], inputs["w"], inputs["idx"]
    x8, s8 = inputs.get("x8"), inputs.get("s8")
    out: list[dict] = []

    def point(fn: Callable[[], Any], **row: Any) -> None:
        out.append(dict(row, table="tune", tokens=n, **bench_like_deepep(fn, *QUICK)))

    def combine_fn(o: Any, push: bool, bn: int, wpb: int) -> Callable[[], Any]:
        res = o.dispatch(x, w, None, idx)
        torch.cuda.synchronize()
        recv = int(res[4][0])
        y = res[0][: max(recv, 1)].clone()
        reg = o.get_registered_combine_input_buffer(torch.bfloat16)
        reg[:recv].copy_(y[:recv])
        inp = y if push else reg
        return lambda: o.combine(inp, res[1], idx, block_num=bn, warp_per_block=wpb, use_external_inp_buf=int(push))

    grids = not getattr(args, "tune_push", False)
    for bn in TUNE_BLOCKS if grids else ():
        for wpb in TUNE_WARPS:
            point(lambda: op.dispatch(x, w, None, idx, block_num=bn, warp_per_block=wpb),
                  kernel="dispatch bf16", blocks=bn, warps=wpb)
            if x8 is not None:
                point(lambda: op.dispatch(x8, w, s8, idx, block_num=bn, warp_per_block=wpb),
                      kernel="dispatch fp8", blocks=bn, warps=wpb)
    variants = [("push", {"MORI_EP_COMBINE_ALGO": "push"}, cfg), ("pull", {"MORI_EP_COMBINE_ALGO": "pull"}, cfg),
                ("push", {"MORI_EP_COMBINE_ALGO": "push"}, dataclasses.replace(cfg, quant_type="fp8_direct_cast"))]
    for algo, env, vcfg in variants if grids else ():
        fp8 = vcfg is not cfg
        with variant_op(vcfg, env, sync) as o:
            for push in ((True,) if fp8 else (True, False)):
                for bn in TUNE_BLOCKS:
                    for wpb in TUNE_WARPS:
                        fn = combine_fn(o, push, bn, wpb)
                        fn()
                        p = o._cached_combine_launch
                        point(fn, kernel="combine fp8_direct_cast" if fp8 else "combine bf16",
                              call="push" if push else "pull", algo=algo, blocks=p.block_num, warps=p.warp_per_block)

    def push_point(env: dict[str, str], quant: str, what: str, **row: Any) -> None:
        env = dict(env, MORI_EP_COMBINE_ALGO="push")
        with variant_op(dataclasses.replace(cfg, quant_type=quant), env, sync) as o:
            fn = combine_fn(o, True, -1, -1)
            fn()
            p = o._cached_combine_launch
            point(fn, kernel=f"combine {'bf16' if quant == 'none' else quant} ({what})", call="push", algo="push",
                  blocks=p.block_num, warps=p.warp_per_block, **row)

    if grids and n == max(wanted):
        for stage_tokens in STAGE_TOKENS:
            for reduce_blocks in REDUCE_BLOCKS:
                env = {"MORI_EP_PUSH_STAGE_TOKENS": str(stage_tokens), "MORI_EP_PUSH_REDUCE_BLOCKS": str(reduce_blocks),
                       "MORI_EP_PUSH_OVERLAP": "0"}
                for quant in ("none", "fp8_direct_cast"):
                    push_point(env, quant, "staging", stage_tokens=stage_tokens, reduce_blocks=reduce_blocks)
    # Overlapped push against push-barrier-reduce, A/B in one run (every rank builds the same ops).
    for overlap, reduce_blocks in [("0", -1)] + [("1", r) for r in OVERLAP_REDUCE_BLOCKS]:
        env = {"MORI_EP_PUSH_STAGE_TOKENS": "0", "MORI_EP_PUSH_OVERLAP": overlap,
               "MORI_EP_PUSH_OVERLAP_REDUCE_BLOCKS": str(reduce_blocks)}
        for quant in ("none", "fp8_direct_cast"):
            push_point(env, quant, "overlap", overlap=overlap, reduce_blocks=reduce_blocks if overlap == "1" else "-")
    op.check_error()
    sync()
    return out


def print_tables(per_rank: dict[int, list[dict]], title: str) -> None:
    """All sweep points (mean over ranks) and the best per kernel and call."""
    import statistics

    from mori_core.bench.table import print_table

    ranks = sorted(per_rank)
    idx = [i for i, r in enumerate(per_rank[ranks[0]]) if r.get("table") == "tune"]
    if not idx:
        return
    merged = []
    for i in idx:
        rs = [per_rank[r][i] for r in ranks]
        merged.append(dict(rs[0], mean_us=statistics.mean(r["mean_us"] for r in rs),
                           host_us=statistics.mean(r["host_us"] for r in rs)))
    headers = ["kernel", "call", "kernel run", "tokens", "blocks x warps", "stage tokens", "overlap", "reduce blocks",
               "mean us", "host us"]

    def line(m: dict) -> list:
        return [m["kernel"], m.get("call", "-"), m.get("algo", "-"), m["tokens"], f"{m['blocks']}x{m['warps']}",
                m.get("stage_tokens", "-"), m.get("overlap", "-"), m.get("reduce_blocks", "-"), m["mean_us"],
                m["host_us"]]

    print_table(title + " (launch sweep, quick: DeepEP bench() with 3 warm-up + 10 timed calls)", headers,
                [line(m) for m in merged])
    best: dict[tuple, dict] = {}
    for m in merged:
        key = (m["kernel"], m.get("call"), m.get("algo"), m["tokens"])
        if key not in best or m["mean_us"] < best[key]["mean_us"]:
            best[key] = m
    print_table(title + " (launch sweep, best per kernel)", headers, [line(m) for m in best.values()])
