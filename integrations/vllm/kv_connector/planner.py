"""Turn (source blocks, destination blocks) of paired layers into engine segments.

Pure functions over :class:`LayerLayout` geometry and block ids (no I/O, no vLLM):

* :func:`zip_runs` pairs two byte-run lists that hold the same logical bytes in the
  same order but possibly cut differently (e.g. ``LBHNC`` on one side, ``LBNHC`` on the
  other): it cuts both at the union of their boundaries.
* :class:`LayerPlanner` plans many layers of one region pair at once: layers whose
  geometry differs only by their offset (all of a model's layers, usually) share one
  template of a block pair, expanded over (layers x blocks) and merged in one pass in the
  core (``mori_core.io.plan.expand_block_segments``), and the result is one segment list in
  int64 arrays (what the engine reads fastest). Templates are cached per (source geometry,
  destination geometry, head pairs), so a request's plan is one core call however many
  layers it has (a Python loop per layer took ~40 us each: 1.3 ms for 32 layers; the numpy
  expansion and merge that followed, 80-170 us per request in a real process).
* :func:`plan_layer` is one layer through the same code (lists, for callers and tests).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from mori_core.io.plan import expand_block_segments
from mori_integrations.common.segments import PlanError, Segments
from mori_integrations.vllm.kv_connector.messages import LayerLayout

__all__ = ["LayerPlanner", "PreparedLayers", "check_pairable", "pair_blocks", "plan_layer", "zip_runs"]

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


Geometry = Tuple[object, ...]


def _geometry(layer: LayerLayout) -> Geometry:
    """Everything of a layer's layout except its name, region and offset."""
    return (layer.group, layer.block_stride, layer.head_stride, layer.num_heads, layer.content,
            tuple(map(tuple, layer.head_runs)), tuple(map(tuple, layer.block_runs)))


class LayerPlanner:
    """Segments of many layers between two regions, one numpy pass per layer geometry (see module docstring).

    Threads may share one: its caches are plain dicts (two threads may compute one template twice).
    """

    _MAX_CACHED = 4096

    def __init__(self) -> None:
        self._geometry: Dict[int, Tuple[LayerLayout, Geometry]] = {}  # id(layout) -> (layout kept alive, key)
        self._templates: Dict[Tuple[Geometry, Geometry, Tuple[Tuple[int, int], ...]], Template] = {}

    def _key(self, layer: LayerLayout) -> Geometry:
        hit = self._geometry.get(id(layer))
        if hit is not None and hit[0] is layer:
            return hit[1]
        if len(self._geometry) >= self._MAX_CACHED:
            self._geometry.clear()
        key = _geometry(layer)
        self._geometry[id(layer)] = (layer, key)
        return key

    def _template(self, src: LayerLayout, dst: LayerLayout, gs: Geometry, gd: Geometry,
                  pairs: Tuple[Tuple[int, int], ...]) -> Template:
        tkey = (gs, gd, pairs)
        t = self._templates.get(tkey)
        if t is None:
            check_pairable(src, dst)
            for hs, hd in pairs:
                if not (0 <= hs < src.num_heads and 0 <= hd < dst.num_heads):
                    raise PlanError(
                        f"layer {src.name}: head pair ({hs}, {hd}) outside {src.num_heads} / {dst.num_heads} heads")
            if len(self._templates) >= self._MAX_CACHED:
                self._templates.clear()
            t = self._templates[tkey] = _template(src, dst, list(pairs))
        return t

    def prepare(self, layers: Sequence[Tuple[LayerLayout, LayerLayout]]) -> "PreparedLayers":
        """What :meth:`plan` needs of ``layers`` that does not depend on the blocks: runs of
        consecutive layers of one geometry and their offsets (callers that plan the same layers
        for many requests keep this: 32 layers cost ~30 us to walk in Python per request)."""
        runs = []
        i = 0
        while i < len(layers):
            src, dst = layers[i]
            gs, gd = self._key(src), self._key(dst)
            j = i + 1
            while j < len(layers) and self._key(layers[j][0]) == gs and self._key(layers[j][1]) == gd:
                j += 1
            off_src = np.fromiter((layers[k][0].offset for k in range(i, j)), dtype=np.int64, count=j - i)
            off_dst = np.fromiter((layers[k][1].offset for k in range(i, j)), dtype=np.int64, count=j - i)
            runs.append(_LayerRun(src, dst, gs, gd, off_src, off_dst))
            i = j
        return PreparedLayers(runs)

    def plan(
        self,
        layers: "Sequence[Tuple[LayerLayout, LayerLayout]] | PreparedLayers",
        src_blocks: npt.NDArray[np.int64],
        dst_blocks: npt.NDArray[np.int64],
        head_pairs: Sequence[Tuple[int, int]],
    ) -> Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(source offsets, destination offsets, sizes) moving ``head_pairs`` of every block pair of
        every ``(source layer, destination layer)``, in layer order, merged where they continue each other.

        ``layers``: the pairs, or what :meth:`prepare` made of them. Offsets are relative to each
        side's registered region (all layers of one call share it). Blocks pair index to index.
        """
        prepared = layers if isinstance(layers, PreparedLayers) else self.prepare(layers)
        empty = np.zeros(0, dtype=np.int64)
        if src_blocks.size != dst_blocks.size:
            name = prepared.runs[0].src.name if prepared.runs else "?"
            raise PlanError(f"layer {name}: {src_blocks.size} source blocks but {dst_blocks.size} destination blocks")
        if src_blocks.size == 0 or not head_pairs or not prepared.runs:
            return empty, empty, empty
        # The template cache's key: callers on the transfer path pass cached_head_pairs' tuple as is.
        pairs = head_pairs if isinstance(head_pairs, tuple) else tuple(map(tuple, head_pairs))
        runs = []
        for run in prepared.runs:  # runs of consecutive layers with one geometry
            t_src, t_dst, t_sz = self._template(run.src, run.dst, run.gs, run.gd, pairs)
            runs.append((run.off_src, run.off_dst, run.src.block_stride, run.dst.block_stride, t_src, t_dst, t_sz))
        # One pass in the core over layers x blocks x template pieces, merging as it goes.
        return expand_block_segments(runs, src_blocks, dst_blocks)


@dataclasses.dataclass(frozen=True)
class _LayerRun:
    """Consecutive layer pairs of one geometry: the first pair (for the template) and every offset."""

    src: LayerLayout
    dst: LayerLayout
    gs: Geometry
    gd: Geometry
    off_src: npt.NDArray[np.int64]
    off_dst: npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True)
class PreparedLayers:
    """Layer pairs as :meth:`LayerPlanner.plan` walks them (see :meth:`LayerPlanner.prepare`)."""

    runs: List[_LayerRun]


def plan_layer(
    src: LayerLayout,
    dst: LayerLayout,
    src_blocks: npt.NDArray[np.int64],
    dst_blocks: npt.NDArray[np.int64],
    head_pairs: Sequence[Tuple[int, int]],
) -> Segments:
    """Segments (source offsets, destination offsets, sizes) moving ``head_pairs`` of every block pair.

    Offsets are relative to each side's registered region. Blocks pair index to index.
    One layer through :class:`LayerPlanner` (lists; a fresh planner, so nothing is cached).
    """
    lo, ro, sz = LayerPlanner().plan([(src, dst)], np.asarray(src_blocks), np.asarray(dst_blocks), head_pairs)
    return lo.tolist(), ro.tolist(), sz.tolist()


def pair_blocks(
    src: Sequence[int], dst: Sequence[int], null_block_id: int
) -> Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Index-aligned block pairs, skipping positions where the destination holds no block.

    Raises PlanError when the destination needs a position the source has no block for
    (e.g. a sliding-window block the source already dropped).
    """
    if len(src) < len(dst):
        raise PlanError(f"the destination expects {len(dst)} blocks but the source holds {len(src)}")
    head = src[: len(dst)]
    s = np.asarray(head, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    if isinstance(dst, list) and isinstance(head, list) and null_block_id not in dst:
        # The usual case (lists from vLLM, no null block): nothing to drop, two list scans.
        if null_block_id in head:
            raise PlanError("the destination needs blocks the source no longer holds (outside its sliding window)")
        return s, d
    keep = d != null_block_id
    if np.any(keep & (s == null_block_id)):
        raise PlanError("the destination needs blocks the source no longer holds (outside its sliding window)")
    return s[keep], d[keep]
