"""Turn (source blocks, destination blocks) of paired layers into engine segments.

Pure functions over :class:`LayerLayout` geometry and block ids (no I/O, no vLLM):

* :func:`zip_runs` pairs two byte-run lists that hold the same logical bytes in the
  same order but possibly cut differently (e.g. ``LBHNC`` on one side, ``LBNHC`` on the
  other): it cuts both at the union of their boundaries.
* :func:`plan_layer` expands the paired template of one block (or of the heads one rank
  provides another) over every block pair and merges segments that continue each
  other on both sides, so contiguous blocks of a block-compact layout become one
  segment per run of blocks.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from mori_integrations.common.segments import PlanError, Segments, merge_adjacent
from mori_integrations.vllm.kv_connector.messages import LayerLayout

__all__ = ["check_pairable", "pair_blocks", "plan_layer", "zip_runs"]

Template = Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]


def zip_runs(src: Sequence[Tuple[int, int]], dst: Sequence[Tuple[int, int]]) -> Template:
    """Pair two run lists of equal total length: ``(src offsets, dst offsets, sizes)``."""
    total_src = sum(n for _, n in src)
    total_dst = sum(n for _, n in dst)
    if total_src != total_dst:
        raise PlanError(f"paired byte ranges differ in size: source {total_src} B, destination {total_dst} B")
    so: List[int] = []
    do: List[int] = []
    sz: List[int] = []
    i = j = 0
    s_off, s_left = src[0] if src else (0, 0)
    d_off, d_left = dst[0] if dst else (0, 0)
    while i < len(src) and j < len(dst):
        n = min(s_left, d_left)
        so.append(s_off)
        do.append(d_off)
        sz.append(n)
        s_off, s_left, d_off, d_left = s_off + n, s_left - n, d_off + n, d_left - n
        if s_left == 0:
            i += 1
            if i < len(src):
                s_off, s_left = src[i]
        if d_left == 0:
            j += 1
            if j < len(dst):
                d_off, d_left = dst[j]
    return np.asarray(so, dtype=np.int64), np.asarray(do, dtype=np.int64), np.asarray(sz, dtype=np.int64)


def check_pairable(src: LayerLayout, dst: LayerLayout) -> None:
    """Raise PlanError when two layers' blocks do not hold the same bytes format."""
    if src.content != dst.content:
        raise PlanError(
            f"layer {src.name}: KV format differs (source {src.content}, destination {dst.content}): "
            "dtype, kernel block size and head size must match"
        )
    if src.group != dst.group:
        raise PlanError(f"layer {src.name}: KV cache group differs (source {src.group}, destination {dst.group})")
    if src.head_bytes != dst.head_bytes:
        raise PlanError(f"layer {src.name}: bytes per head and block differ ({src.head_bytes} vs {dst.head_bytes})")


def _template(src: LayerLayout, dst: LayerLayout, pairs: Sequence[Tuple[int, int]]) -> Template:
    """Segments of one block pair, relative to each side's block start."""
    whole = len(pairs) == src.num_heads == dst.num_heads and all(a == b for a, b in pairs)
    if whole and pairs == sorted(pairs):
        return zip_runs(src.block_runs, dst.block_runs)
    parts = [zip_runs(src.head_runs, dst.head_runs) for _ in pairs]
    so = np.concatenate([p[0] + hs * src.head_stride for p, (hs, _) in zip(parts, pairs)])
    do = np.concatenate([p[1] + hd * dst.head_stride for p, (_, hd) in zip(parts, pairs)])
    sz = np.concatenate([p[2] for p in parts])
    return so, do, sz


def plan_layer(
    src: LayerLayout,
    dst: LayerLayout,
    src_blocks: npt.NDArray[np.int64],
    dst_blocks: npt.NDArray[np.int64],
    head_pairs: Sequence[Tuple[int, int]],
) -> Segments:
    """Segments (source offsets, destination offsets, sizes) moving ``head_pairs`` of every block pair.

    Offsets are relative to each side's registered region. Blocks pair index to index.
    """
    if src_blocks.size != dst_blocks.size:
        raise PlanError(f"layer {src.name}: {src_blocks.size} source blocks but {dst_blocks.size} destination blocks")
    if src_blocks.size == 0 or not head_pairs:
        return [], [], []
    check_pairable(src, dst)
    for hs, hd in head_pairs:
        if not (0 <= hs < src.num_heads and 0 <= hd < dst.num_heads):
            raise PlanError(f"layer {src.name}: head pair ({hs}, {hd}) outside {src.num_heads} / {dst.num_heads} heads")
    t_src, t_dst, t_sz = _template(src, dst, list(head_pairs))
    base_src = src.offset + src_blocks.astype(np.int64) * src.block_stride
    base_dst = dst.offset + dst_blocks.astype(np.int64) * dst.block_stride
    local = (base_src[:, None] + t_src[None, :]).ravel()
    remote = (base_dst[:, None] + t_dst[None, :]).ravel()
    sizes = np.broadcast_to(t_sz, (src_blocks.size, t_sz.size)).ravel()
    return merge_adjacent(local, remote, sizes)


def pair_blocks(
    src: Sequence[int], dst: Sequence[int], null_block_id: int
) -> Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Index-aligned block pairs, skipping positions where the destination holds no block.

    Raises PlanError when the destination needs a position the source has no block for
    (e.g. a sliding-window block the source already dropped).
    """
    if len(src) < len(dst):
        raise PlanError(f"the destination expects {len(dst)} blocks but the source holds {len(src)}")
    s = np.asarray(src[: len(dst)], dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    keep = d != null_block_id
    if np.any(keep & (s == null_block_id)):
        raise PlanError("the destination needs blocks the source no longer holds (outside its sliding window)")
    return s[keep], d[keep]
