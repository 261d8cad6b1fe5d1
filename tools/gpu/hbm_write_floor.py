"""What one GPU's memory takes to write the standard-MoE layout's bytes: the floor the expand
kernel of dispatch_standard_moe is measured against (docs/ep.md, issue #31 round 13).

At EP2 x 128 tokens (hidden 7168 bf16, top-8 of 256 experts) a rank receives about 256 rows and
writes about 1,024 layout rows (four local experts per row): 14.7 MB; at 512 tokens four times
that. For each size this times, on one GPU, in CUDA graph replays of REPS calls back to back
(median of ROUNDS replays, per call):

* fill: ``zero_()`` of the bytes (writes only);
* copy: ``copy_()`` of the bytes from another buffer (as many reads as writes);
* expand: ``index_copy_`` of rows from a quarter-sized buffer, each row to four places (what the
  expand does: one read per four writes), rows of ``hidden`` bf16 elements.

    python3 tools/gpu/hbm_write_floor.py [layout rows, default 1024 4096] [--hidden 7168]
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from mori_core.bench.ep.measure import time_graph


def _per_call_us(fn: Callable[[], None], reps: int, rounds: int) -> float:
    """Median over ``rounds`` graph replays of ``reps`` back-to-back calls of fn, per call (us):
    the bench's own graph timing (``mori_core.bench.ep.measure.time_graph``)."""
    opts = argparse.Namespace(no_graph=False, ops_per_graph=reps, warmup=3, iters=rounds)
    return time_graph(fn, opts, sync=lambda: None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="*", type=int, default=[1024, 4096], help="layout rows written")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--fan", type=int, default=4, help="layout rows per received row")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(dev)}; hidden {args.hidden} bf16, {args.fan} layout rows per row")
    print("| layout rows | MB written | fill us (TB/s) | copy us (TB/s written) | expand-like us (TB/s written) |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        src_rows = max(1, rows // args.fan)
        dst = torch.empty(rows, args.hidden, dtype=torch.bfloat16, device=dev)
        full = torch.randn(rows, args.hidden, device=dev).to(torch.bfloat16)
        src = full[:src_rows].clone()
        # each received row to `fan` rows spread over the layout, as the experts' blocks are
        perm = torch.randperm(rows, device=dev)
        pick = torch.arange(rows, device=dev) % src_rows
        nbytes = rows * args.hidden * 2
        fill = _per_call_us(lambda: dst.zero_(), args.reps, args.rounds)
        copy = _per_call_us(lambda: dst.copy_(full), args.reps, args.rounds)
        expand = _per_call_us(lambda: dst.index_copy_(0, perm, src.index_select(0, pick)), args.reps, args.rounds)
        # index_select materialises the gathered rows first: that read+write is part of torch's way
        gather = _per_call_us(lambda: src.index_select(0, pick), args.reps, args.rounds)
        tb = lambda us: nbytes / us / 1e6  # noqa: E731 (bytes per us -> TB/s)
        print(f"| {rows} | {nbytes / 1e6:.1f} | {fill:.2f} ({tb(fill):.2f}) | {copy:.2f} ({tb(copy):.2f}) | "
              f"{expand:.2f} ({tb(expand):.2f}; of which the gather {gather:.2f}) |")


if __name__ == "__main__":
    main()
