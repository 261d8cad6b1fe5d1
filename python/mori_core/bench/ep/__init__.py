"""MORI-EP benchmarks: ``python -m mori_core.bench ep [options]``.

One package, one measurement: :mod:`.measure` places and starts the ranks, times calls (eager,
host, CUDA graph), runs the NCCL baseline and merges the ranks' rows; each kernel family calls it:

* :mod:`.intranode` -- IntraNode dispatch/combine (default ``--kernel-type IntraNode``), with the
  FP8-combine and standard-MoE rows of :mod:`.extensions`, DeepEP's intranode kernels on the same
  data (``--deepep``, :mod:`.deepep_normal`), the launch-knob sweep (``--tune``, :mod:`.tune`) and
  a PNG chart (``--plot``, :mod:`mori_core.bench.plot`);
* :mod:`.internode` -- the inter-node kernel types (``--kernel-type InterNodeV1,...``).

A family module has ``rank_main(rank, world, port, args, results)`` (one spawned rank) and
``report(per_rank, args, world, where)`` (its tables).

Ranks are placed by :mod:`mori_core.placement`: ``--world-size`` beyond the GPU count puts several
ranks on a GPU (``MORI_RANKS_PER_GPU``), and the tables then show host time only.
"""

from __future__ import annotations

import argparse
import os

from mori_core.bench.ep import deepep_normal, extensions, internode, tune, v2


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``python -m mori_core.bench ep`` (both kernel families)."""
    p.add_argument("--world-size", type=int, default=0,
                   help="ranks (default: one per visible GPU); more ranks than GPUs share them (MORI_RANKS_PER_GPU), "
                        "e.g. --world-size 8 on one GPU: host times only")
    p.add_argument("--tokens", default="128,512,4096", help="tokens per rank, comma separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256, help="total experts")
    p.add_argument("--dtypes", default="bf16,fp8", help="dispatch dtypes: bf16, fp8 (with fp32 scales), fp32")
    p.add_argument("--scale-dim", type=int, default=56, help="fp32 scales per token for fp8 dispatch")
    p.add_argument("--zero-copy", default="both", choices=["0", "1", "both"], help="combine: 1 = pull, 0 = push")
    p.add_argument("--dispatch-block-num", type=int, default=-1)
    p.add_argument("--dispatch-warp-per-block", type=int, default=-1)
    p.add_argument("--combine-block-num", type=int, default=-1)
    p.add_argument("--combine-warp-per-block", type=int, default=-1)
    p.add_argument("--auto", action="store_true", help="MORI_EP_LAUNCH_CONFIG_MODE=AUTO (tuned table)")
    p.add_argument(
        "--sms", type=int, default=0,
        help="run every kernel with this many blocks (at most this many SMs); overrides --*-block-num and AUTO",
    )
    p.add_argument("--iters", type=int, default=20, help="graph replays per measurement")
    p.add_argument("--ops-per-graph", type=int, default=10, help="back-to-back launches per captured graph")
    p.add_argument("--eager-calls", type=int, default=50, help="eager calls per measurement (first one dropped)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing (eager and host only)")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL all_to_all_single baseline")
    p.add_argument("--sweep", action="store_true", help="sweep (block_num, warp_per_block) per kernel")
    p.add_argument("--sweep-kernels", default="dispatch,combine",
                   help="which kernels --sweep covers (dispatch, combine); the others run once, at their AUTO grid")
    p.add_argument("--json", default="", help="write all measurements to this file")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kernel-type", default="IntraNode",
                   help="comma-separated kernel types; any inter-node type (InterNode, InterNodeV1, InterNodeV1LL, "
                        "AsyncLL) runs the inter-node benchmark (mori_core.bench.ep.internode)")
    p.add_argument("--gpu-per-node", type=int, default=0, help="inter-node types: GPUs per node (default: all)")
    p.add_argument("--rdma-block-num", type=int, default=-1, help="inter-node V1/V1LL: blocks staging network rows")
    p.add_argument("--plot", metavar="FILE", default="",
                   help="write a PNG of time per call against tokens per rank (ours, DeepEP, NCCL); needs matplotlib")
    extensions.add_arguments(p)
    internode.add_arguments(p)
    v2.add_arguments(p)
    deepep_normal.add_arguments(p)
    tune.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Place the ranks and run the benchmark of the chosen kernel family; returns the exit code."""
    import torch

    from mori_core.bench.ep.measure import place_ranks, shared_gpu_settings, spawn_ranks

    if args.auto:
        os.environ["MORI_EP_LAUNCH_CONFIG_MODE"] = "AUTO"
    world = args.world_size or torch.cuda.device_count()
    if world < 1 or torch.cuda.device_count() < 1:
        print("ep benchmark: no GPU visible")
        return 2
    where = place_ranks(world)
    shared_gpu_settings(args, where)
    if args.kernel_type != "IntraNode":
        from mori_core.bench.ep import internode as family
    else:
        from mori_core.bench.ep import intranode as family
    per_rank = spawn_ranks(family.rank_main, world, args)
    if per_rank is None:
        return 1
    return family.report(per_rank, args, world, where)
