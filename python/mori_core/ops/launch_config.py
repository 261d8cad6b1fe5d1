"""Launch parameters of the EP kernels: per-call overrides, AUTO tables, config defaults.

Resolution order for each of ``block_num`` / ``warp_per_block``:
explicit per-call value (> 0)  >  AUTO table (``MORI_EP_LAUNCH_CONFIG_MODE=AUTO``)  >  config.

The AUTO tables hold values measured with ``python -m mori_core.bench ep --sweep`` on
4×H200 (EP2 and EP4, hidden 7168, top-8 of 256); H100 shares the Hopper table (same SM
count), EP8 uses the EP4 table. Other GPUs fall back to "one block per SM, 8 warps".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

LAUNCH_MODE_ENV = "MORI_EP_LAUNCH_CONFIG_MODE"
COMBINE_ALGO_ENV = "MORI_EP_COMBINE_ALGO"
# The IntraNode combine kernels (EpCombineMode in ops/ep_types.hpp). "pull_or_push": the pull
# kernel, except that a round whose every source dispatched at most MORI_EP_PULL_PUSH_TOKENS
# tokens (default 256) pushes the registered rows (decided on the device, alike on every rank).
COMBINE_MODES = {"pull": 0, "push": 1, "copy_pull": 2, "pull_or_push": 3}


@dataclass(frozen=True)
class LaunchParams:
    """Grid of one kernel launch; ``mode`` is the IntraNode combine kernel a combine runs
    (:data:`COMBINE_MODES`; -1 where it does not apply)."""

    block_num: int
    warp_per_block: int
    mode: int = -1


# (max tokens per rank, block_num, warp_per_block); the first row whose bound >= tokens wins.
# Kernels: "dispatch", "combine_push", "combine_pull". Measured on 4x H200 (132 SMs) with
# `python -m mori_core.bench ep --sweep` (hidden 7168, top-8 of 256, uniform routing). The
# dispatch rows assume its per-destination copy, which large grids get (MORI_EP_DISPATCH_PER_DEST_WARPS):
# with it the dispatch speeds up with more warps; the plain copy slowed down beyond ~128 (docs/ep.md).
_BIG = 1 << 30
_HOPPER_TABLES: dict[str, dict[str, list[tuple[int, int, int]]]] = {
    "ep2": {
        "dispatch": [(256, 132, 4), (1024, 132, 8), (_BIG, 132, 16)],
        "combine_push": [(256, 132, 8), (1024, 132, 16), (_BIG, 264, 8)],
        "combine_pull": [(256, 132, 4), (1024, 96, 8), (_BIG, 132, 8)],
    },
    "ep4+": {
        # the per-destination copy (>= 512 warps, MORI_EP_DISPATCH_PER_DEST_WARPS): 4xH100 sweep
        # of issue #31 round 8; best or within 1 % at 128 / 512 / 4096 tokens, bf16 and fp8
        "dispatch": [(256, 132, 4), (_BIG, 132, 16)],
        "combine_push": [(256, 132, 8), (1024, 264, 8), (_BIG, 132, 16)],
        "combine_pull": [(256, 132, 8), (1024, 96, 8), (_BIG, 132, 4)],
    },
}


def launch_mode() -> str:
    """"AUTO" or "MANUAL" (default) from MORI_EP_LAUNCH_CONFIG_MODE."""
    mode = os.environ.get(LAUNCH_MODE_ENV, "MANUAL").strip().upper()
    if mode not in ("AUTO", "MANUAL"):
        raise ValueError(f"{LAUNCH_MODE_ENV}={mode!r} must be AUTO or MANUAL")
    return mode


def auto_params(kernel: str, num_tokens: int, sm_count: int, arch_major: int, world_size: int = 4) -> LaunchParams:
    """Tuned (block_num, warp_per_block) for ``kernel`` at ``num_tokens`` tokens per rank.

    Hopper (H100/H200) uses the measured tables (EP8 takes the EP4 table); other GPUs get one
    block per SM with 8 warps. Block counts scale with the SM count of the device."""
    if arch_major == 9 and sm_count >= 114:
        table = _HOPPER_TABLES["ep2" if world_size <= 2 else "ep4+"][kernel]
        for bound, blocks, warps in table:
            if num_tokens <= bound:
                return LaunchParams(max(1, blocks * sm_count // 132), warps)
    return LaunchParams(sm_count, 8)


def resolve(
    kernel: str,
    num_tokens: int,
    block_num: int,
    warp_per_block: int,
    config_block_num: int,
    config_warp_per_block: int,
    sm_count: int,
    arch_major: int,
    mode: Optional[str] = None,
    world_size: int = 4,
) -> LaunchParams:
    """Apply the resolution order documented in the module docstring."""
    mode = launch_mode() if mode is None else mode
    base = (
        auto_params(kernel, num_tokens, sm_count, arch_major, world_size)
        if mode == "AUTO"
        else LaunchParams(config_block_num, config_warp_per_block)
    )
    return LaunchParams(
        block_num if block_num > 0 else base.block_num,
        warp_per_block if warp_per_block > 0 else base.warp_per_block,
    )


MAX_WARPS_PER_BLOCK = 512 // 32  # the kernels launch at most 512 threads per block


def checked_grid(p: LaunchParams) -> LaunchParams:
    """``p`` when launchable (1..16 warps, at least one block), else ValueError naming the value."""
    if not 1 <= p.warp_per_block <= MAX_WARPS_PER_BLOCK:
        raise ValueError(
            f"warp_per_block={p.warp_per_block} must be in [1, {MAX_WARPS_PER_BLOCK}] (512 threads per block)"
        )
    if p.block_num < 1:
        raise ValueError(f"block_num={p.block_num} must be >= 1")
    return p


# MORI's AUTO table for the inter-node kernel types (its EP guide, "Launch Configuration"):
# name -> (block_num, rdma_block_num, warp_per_block).
INTERNODE_AUTO = {
    "InterNodeV1": (96, 64, 8),
    "InterNodeV1LL": (96, 64, 8),
    "InterNode": (128, 0, 16),
    "AsyncLL": (128, 0, 16),
}


def resolve_internode(
    kernel_type: str,
    block_num: int,
    rdma_block_num: int,
    warp_per_block: int,
    config_block_num: int,
    config_rdma_block_num: int,
    config_warp_per_block: int,
    mode: Optional[str] = None,
) -> tuple[int, int, int]:
    """(block_num, rdma_block_num, warp_per_block) of an inter-node kernel launch: explicit
    per-call values (> 0) > MORI's AUTO table (``MORI_EP_LAUNCH_CONFIG_MODE=AUTO``) > config."""
    mode = launch_mode() if mode is None else mode
    base = INTERNODE_AUTO[kernel_type] if mode == "AUTO" else (config_block_num, config_rdma_block_num,
                                                                config_warp_per_block)
    return (
        block_num if block_num > 0 else base[0],
        rdma_block_num if rdma_block_num > 0 else base[1],
        warp_per_block if warp_per_block > 0 else base[2],
    )


# ----------------------------------------------------------------------------- combine kernel
def combine_algorithm_override() -> str:
    """``MORI_EP_COMBINE_ALGO``: ``auto`` (default), ``push`` or ``pull`` (see :func:`combine_mode`)."""
    algo = os.environ.get(COMBINE_ALGO_ENV, "auto").strip().lower() or "auto"
    if algo not in ("auto", "push", "pull"):
        raise ValueError(f"{COMBINE_ALGO_ENV}={algo!r} must be auto, push or pull")
    return algo


def combine_mode(push_call: bool, quant: int, algo: str = "auto") -> int:
    """The combine kernel (a :data:`COMBINE_MODES` value) that moves a combine's bytes fastest.

    ``push_call``: the caller's rows are an unregistered tensor (``use_external_inp_buf=1``),
    else they are in the registered buffer (pull, zero-copy). Either kernel serves either call:
    a push call runs the pull kernel after a local copy into the registered buffer
    (``copy_pull``), a pull call runs the push kernel reading the registered buffer. The result
    is the same bit for bit (fp32 sums in ascending rank order, FP8 rows quantised alike).

    ``algo`` = ``push`` / ``pull`` forces the kernel; ``auto`` chooses:

    * FP8 combine (``quant`` != 0): push. The pull kernel quantises every row into local staging
      before its barrier and only then can the peers read: two passes, one after the other.
    * otherwise push calls push, and pull calls pull but push small rounds (``pull_or_push``: no
      extra pass over the rows either way). Measured on 4xH100 (EP4, round 1 of issue #31,
      docs/ep.md): for a push call the push kernel beat copy-pull at every size (128 / 512 / 4096
      tokens: 33.6 / 87.7 / 609 us against - / 104 / 683 us); for a pull call the pull kernel beat
      the push kernel from 512 tokens (80 / 505 us against 88 / 627 us) and trailed it by 4 us at
      128 (round 7, kernel alone: 36.8-38.0 against 32.2 us), hence the push for small rounds.

    The choice depends only on values every rank shares (never on this rank's token count): all
    ranks must run the same kernel, or their barriers would never meet.
    """
    if algo == "push":
        return COMBINE_MODES["push"]
    if algo == "pull":
        return COMBINE_MODES["copy_pull"] if push_call else COMBINE_MODES["pull"]
    if quant != 0 or push_call:
        return COMBINE_MODES["push"]
    return COMBINE_MODES["pull_or_push"]


def combine_table_kernel(mode: int) -> str:
    """The launch-table kernel name of a combine kernel mode."""
    return "combine_push" if mode == COMBINE_MODES["push"] else "combine_pull"
