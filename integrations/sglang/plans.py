"""Turn SGLang page/slot indices into byte ranges for ``IOEngine.batch_write``.

Pure functions over numbers (no I/O), so every layout rule is testable alone:

* SGLang pools are token-major per region: page ``p`` of a region with
  ``item_len`` bytes per page is bytes ``[p * item_len, (p + 1) * item_len)``.
  Runs of pages contiguous on both sides become one segment.
* MHA with different prefill/decode TP: a page holds ``page_size`` tokens of
  ``[heads, head_dim]``; each token's head slice is one segment.
* One chunk's writes, over every region pair and peer, are collected in a
  :class:`WriteBatch` and submitted with a single ``batch_write`` call. Page
  segments are int64 arrays (the engine reads an array with one copy).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from mori_integrations.common.segments import (  # noqa: F401  (re-exported)
    PlanError,
    Segments,
    TransferBatch,
    as_indices,
    contiguous_segments,
    index_runs,
)

# Shared with the other adapters; SGLang code keeps importing the names from here.
WriteBatch = TransferBatch


@dataclasses.dataclass(frozen=True)
class HeadSlice:
    """Which KV heads one prefill rank writes into one decode rank (per token)."""

    src_heads: int  # heads per token in the prefill region
    dst_heads: int  # heads per token in the decode region
    src_head_start: int
    dst_head_start: int
    num_heads: int

    @classmethod
    def between(cls, total_heads: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> "HeadSlice":
        """SGLang's own head mapping (GQA replication included) for a TP pair."""
        from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params

        src_start, num, dst_start, _ = compute_head_slice_params(src_tp, dst_tp, src_rank, dst_rank, total_heads)
        return cls(
            src_heads=max(1, total_heads // src_tp),
            dst_heads=max(1, total_heads // dst_tp),
            src_head_start=src_start,
            dst_head_start=dst_start,
            num_heads=num,
        )


def head_slice_segments(
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
    page_size: int,
    src_item_len: int,
    dst_item_len: int,
    heads: HeadSlice,
) -> Segments:
    """Per-token head slices from prefill pages into decode pages (MHA, TP mismatch), as int64 arrays."""
    if src.size != dst.size:
        raise PlanError(f"{src.size} prefill pages but {dst.size} decode pages")
    head_len = src_item_len // (page_size * heads.src_heads)
    if head_len * page_size * heads.src_heads != src_item_len or head_len * page_size * heads.dst_heads != dst_item_len:
        raise PlanError(
            f"KV page sizes (prefill {src_item_len} B, decode {dst_item_len} B) do not split into "
            f"{heads.src_heads} / {heads.dst_heads} heads of equal size with page_size={page_size}"
        )
    if heads.src_head_start + heads.num_heads > heads.src_heads or heads.dst_head_start + heads.num_heads > heads.dst_heads:
        raise PlanError(f"head slice {heads} exceeds the heads of a page")
    if heads.num_heads == heads.src_heads == heads.dst_heads:
        return contiguous_segments(src, dst, src_item_len, dst_item_len, as_lists=False)
    slots = np.arange(page_size, dtype=np.int64)
    src, dst = src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False)
    local = src[:, None] * src_item_len + slots * (heads.src_heads * head_len) + heads.src_head_start * head_len
    remote = dst[:, None] * dst_item_len + slots * (heads.dst_heads * head_len) + heads.dst_head_start * head_len
    size = heads.num_heads * head_len
    return local.ravel(), remote.ravel(), np.full(local.size, size, dtype=np.int64)


def pair_entries(
    src_layer_ids: Sequence[int],
    dst_layer_ids: Sequence[int],
    n_src: int,
    n_dst: int,
    *,
    allow_positional_fallback: bool = True,
) -> List[Tuple[int, int]]:
    """(prefill entry, decode entry) pairs, matched by model layer id when both sides give ids.

    Repeated layer ids (K then V of one layer) pair in order. Without ids only
    equal-length lists pair positionally (PP stages of different sizes need ids).
    """
    from sglang.srt.disaggregation.utils import build_transfer_entry_pairs

    try:
        return build_transfer_entry_pairs(
            list(src_layer_ids), list(dst_layer_ids), n_src, n_dst, allow_positional_fallback=allow_positional_fallback
        )
    except RuntimeError as e:
        raise PlanError(str(e)) from None


def mamba_segments(
    src_slot: int,
    dst_slot: int,
    src_item_len: int,
    dst_item_len: int,
    tp_slice: Optional[dict],
) -> Segments:
    """One request's Mamba state of one tensor: the whole slot, or SGLang's TP slices of it."""
    if tp_slice is None:
        if src_item_len != dst_item_len:
            raise PlanError(f"Mamba state sizes differ: prefill {src_item_len} B, decode {dst_item_len} B")
        return [src_slot * src_item_len], [dst_slot * dst_item_len], [src_item_len]
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_byte_blocks

    blocks = compute_mamba_state_slice_byte_blocks(src_item_len=src_item_len, dst_item_len=dst_item_len, **tp_slice)
    return (
        [src_slot * src_item_len + s for s, _, _ in blocks],
        [dst_slot * dst_item_len + d for _, d, _ in blocks],
        [n for _, _, n in blocks],
    )
