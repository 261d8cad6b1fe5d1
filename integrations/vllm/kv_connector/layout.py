"""Describe vLLM's KV cache tensors as registered regions plus per-layer byte geometry.

vLLM 0.30-0.33 allocate every layer's KV as a 4D view ``[kernel blocks, heads, tokens,
content]`` into one backing allocation; the physical order of those dims depends on the
layout (``LBHNC``, ``LBNHC``, ...) and a manager block may span several kernel blocks.
Nothing here assumes a particular layout: the byte runs of a block (and of one head of
a block) are derived from the view's own strides, so any stride permutation vLLM picks
is described exactly. Each distinct backing storage becomes one region to register.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Mapping, Sequence, Tuple

from mori_integrations.vllm.kv_connector.messages import LayerLayout

__all__ = ["KVRegion", "KVLayout", "describe_kv_caches", "strided_runs"]


def strided_runs(sizes: Sequence[int], strides: Sequence[int], elem_bytes: int) -> List[Tuple[int, int]]:
    """Byte runs ``(offset, length)`` of a strided array, in row-major logical order.

    ``strides`` are in bytes. Adjacent runs that touch are merged, so a dense array is
    one run.
    """
    if len(sizes) != len(strides):
        raise ValueError(f"{len(sizes)} sizes but {len(strides)} strides")
    dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
    if any(n == 0 for n in sizes):
        return []
    if any(s <= 0 for _, s in dims):
        raise ValueError(f"KV view has a non-positive stride {tuple(strides)}; only plain strided views are supported")
    run = elem_bytes
    inner = len(dims)
    while inner > 0 and dims[inner - 1][1] == run:
        run *= dims[inner - 1][0]
        inner -= 1
    outer = dims[:inner]
    runs: List[Tuple[int, int]] = []
    for index in itertools.product(*(range(n) for n, _ in outer)):
        off = sum(i * s for i, (_, s) in zip(index, outer))
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + run)
        else:
            runs.append((off, run))
    return runs


@dataclasses.dataclass(frozen=True)
class KVRegion:
    """One backing allocation to register with the IO engine."""

    ptr: int
    nbytes: int
    device_index: int  # -1 for host memory


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Regions plus the geometry of every transferable layer (one entry per distinct view)."""

    regions: List[KVRegion]
    layers: List[LayerLayout]


def describe_kv_caches(
    kv_caches: Mapping[str, "torch.Tensor"],  # noqa: F821
    layer_groups: Mapping[str, int],
    num_blocks: int,
) -> KVLayout:
    """Geometry of vLLM's per-layer KV views.

    Args:
        kv_caches: ``register_kv_caches``' dict, layer name -> 4D view ``[kernel blocks, H, N, C]``.
        layer_groups: layer name -> KV cache group index; layers without a group are skipped.
        num_blocks: manager blocks per layer (``KVCacheConfig.num_blocks``).

    Raises:
        ValueError: a view that is not 4D, or whose kernel blocks do not split into
            ``num_blocks`` manager blocks.
    """
    regions: List[KVRegion] = []
    region_of: Dict[int, int] = {}
    layers: List[LayerLayout] = []
    seen_views: Dict[Tuple[int, Tuple[int, ...], Tuple[int, ...], int], str] = {}
    for name, t in kv_caches.items():
        group = layer_groups.get(name)
        if group is None:
            continue
        if t.dim() != 4:
            raise ValueError(
                f"KV cache of layer {name} has shape {tuple(t.shape)}; the connector supports vLLM's 4D "
                "[blocks, heads, tokens, content] views (vLLM 0.30-0.33)"
            )
        # Cross-layer KV sharing gives two layers of one group the same view: move it once. Layers
        # of different groups may overlay the same bytes too (hybrid allocator), but each group
        # addresses them with its own block ids, so they stay separate entries.
        view_key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), int(group))
        if view_key in seen_views:
            continue
        seen_views[view_key] = name
        kernel_blocks, heads, tokens, content = t.shape
        if num_blocks <= 0 or kernel_blocks % num_blocks:
            raise ValueError(f"layer {name}: {kernel_blocks} kernel blocks do not split into {num_blocks} blocks")
        ratio = kernel_blocks // num_blocks
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base not in region_of:
            region_of[base] = len(regions)
            device = t.device.index if t.device.type == "cuda" else -1
            regions.append(KVRegion(ptr=base, nbytes=storage.nbytes(), device_index=-1 if device is None else device))
        e = t.element_size()
        s_block, s_head, s_tok, s_c = (s * e for s in t.stride())
        layers.append(
            LayerLayout(
                name=name,
                group=int(group),
                region=region_of[base],
                offset=t.data_ptr() - base,
                block_stride=ratio * s_block,
                head_stride=s_head,
                num_heads=heads,
                head_runs=strided_runs((ratio, tokens, content), (s_block, s_tok, s_c), e),
                block_runs=strided_runs((heads, ratio, tokens, content), (s_head, s_block, s_tok, s_c), e),
                content=f"{str(t.dtype).replace('torch.', '')}:{tokens}x{content}",
            )
        )
    if not layers:
        raise ValueError("no KV cache layer belongs to a transferable KV cache group")
    return KVLayout(regions=regions, layers=layers)
