"""vLLM-style KV cache views for tests that fake only vLLM's side.

Mirrors vLLM 0.30's ``allocate_kv_cache`` / ``create_kv_cache_views``: one int8
backing buffer, a 5D strided view ``[layers, kernel blocks, heads, tokens, content]``
whose physical dim order is the KV cache layout (``LBHNC``, ``LBNHC``, ``BLHNC``), and
one 4D ``[kernel blocks, heads, tokens, content]`` view per layer. A manager block
spans ``ratio`` kernel blocks.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4)}


def layer_names(num_layers: int) -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_kv_views(
    num_layers: int,
    num_blocks: int,
    heads: int,
    tokens: int,
    content: int,
    dtype: torch.dtype = torch.float32,
    layout: str = "LBHNC",
    device: str = "cpu",
    ratio: int = 1,
) -> Dict[str, torch.Tensor]:
    """Layer name -> 4D view, all in one zeroed backing buffer on ``device``."""
    elem = torch.empty(0, dtype=dtype).element_size()
    logical = [num_layers, num_blocks * ratio, heads, tokens // ratio, content * elem]
    strides = [0] * 5
    running = 1
    for axis in reversed(LAYOUTS[layout]):
        strides[axis] = running
        running *= logical[axis]
    buf = torch.zeros(running, dtype=torch.int8, device=device)
    view5 = torch.as_strided(buf, logical, strides)
    return {name: view5[i].view(dtype) for i, name in enumerate(layer_names(num_layers))}


def block_heads(view: torch.Tensor, blocks: List[int], ratio: int = 1) -> np.ndarray:
    """Manager blocks of one layer as ``[n, heads, ratio * tokens, content]`` (logical order), on the host."""
    parts = []
    for b in blocks:
        kb = view[b * ratio : (b + 1) * ratio]  # [ratio, H, N, C]
        parts.append(kb.permute(1, 0, 2, 3).reshape(kb.shape[1], -1, kb.shape[3]))
    return torch.stack(parts).cpu().numpy() if parts else np.zeros((0,), dtype=np.float32)
