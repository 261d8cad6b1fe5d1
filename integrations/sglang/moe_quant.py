"""Torch versions of the two aiter quantisers SGLang's MORI dispatcher calls (ROCm-only in aiter).

SGLang's ``moriep.py`` quantises tokens before the dispatch wire with
``get_hip_quant(QuantType.per_1x128)`` (FP8, one fp32 scale per 128 channels) and
``get_hip_quant(QuantType.per_1x32)`` (MX: group-32 scales). These functions give the same
outputs and layouts with plain torch ops, so they run on NVIDIA (and CPU) and can be captured in
CUDA graphs:

* ``per_1x128(x, quant_dtype=fp8)`` -> ``(q [n, h] fp8, scale [n, h / 128] float32)`` with
  ``scale = amax(block) / fp8_max`` (1 for an all-zero block) and ``q = fp8(x / scale)``;
  ``x ~= q * scale``.
* ``per_1x32(x, quant_dtype=fp8, scale_type=float8_e8m0fnu)`` (MXFP8) -> ``(q [n, h] fp8,
  scale [n, h / 32] e8m0)``: a power-of-two scale per 32 channels, the smallest one that keeps
  the block within the fp8 range (``2 ** ceil(log2(amax / fp8_max))``, no saturation);
  ``scale_type=None`` returns the same scales as float32.
* MXFP4 (``per_1x32`` with an fp4 ``quant_dtype``, aiter's default) is refused: the FP4 MoE path
  is not available on NVIDIA in mori-suite.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

import torch

FP4_ENV_HINT = (
    "MXFP4 dispatch (SGLANG_MORI_DISPATCH_DTYPE=fp4, or auto with FP4 weights) is not supported on NVIDIA by "
    "mori-suite; set SGLANG_MORI_DISPATCH_DTYPE=fp8 or bf16"
)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)
_FP8 = tuple(
    dt for dt in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e4m3fnuz", None)) if dt is not None
)


class QuantType(enum.IntEnum):
    """aiter's quantisation granularities (names as ``aiter.QuantType``)."""

    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if x.shape[1] % block:
        raise ValueError(f"hidden size {x.shape[1]} must be a multiple of the quantisation block {block}")
    return x.float().view(x.shape[0], x.shape[1] // block, block)


def _fp8_max(quant_dtype: Any) -> float:
    if quant_dtype not in _FP8:
        raise ValueError(f"quant_dtype must be one of {list(_FP8)}, got {quant_dtype}")
    return float(torch.finfo(quant_dtype).max)


def per_1x128(
    x: torch.Tensor, scale: Optional[torch.Tensor] = None, quant_dtype: Any = torch.float8_e4m3fn, shuffle: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one float32 scale per 128 channels: ``(q [n, h], scale [n, h / 128])``.

    ``scale`` (precomputed scales) and ``shuffle`` (an aiter weight layout) are not supported."""
    if scale is not None or shuffle:
        raise ValueError("per_1x128: precomputed scale= and shuffle=True are not supported (dynamic scales only)")
    fmax = _fp8_max(quant_dtype)
    b = _blocks(x, 128)
    s = b.abs().amax(dim=-1) / fmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (b / s.unsqueeze(-1)).clamp(-fmax, fmax).to(quant_dtype)
    return q.view(x.shape), s


def per_1x32(
    x: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
    quant_dtype: Any = _FP4,
    scale_type: Any = None,
    shuffle: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantisation with one power-of-two scale per 32 channels (MXFP8; MXFP4 is refused)."""
    if _FP4 is not None and quant_dtype == _FP4:
        raise NotImplementedError(FP4_ENV_HINT)
    if scale is not None or shuffle:
        raise ValueError("per_1x32: precomputed scale= and shuffle=True are not supported (dynamic scales only)")
    fmax = _fp8_max(quant_dtype)
    b = _blocks(x, 32)
    amax = b.abs().amax(dim=-1)
    exp = torch.ceil(torch.log2(amax / fmax))
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-127, 127)
    s = torch.exp2(exp)
    q = (b / s.unsqueeze(-1)).clamp(-fmax, fmax).to(quant_dtype)
    if scale_type is None or scale_type == torch.float32:
        return q.view(x.shape), s
    if _E8M0 is None or scale_type != _E8M0:
        raise ValueError(f"scale_type must be torch.float8_e8m0fnu or float32, got {scale_type}")
    return q.view(x.shape), (exp + 127).to(torch.uint8).view(_E8M0)


def get_hip_quant(quant_type: QuantType) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The quantiser of ``quant_type`` (aiter's name; per_1x128 and per_1x32 are provided)."""
    if quant_type == QuantType.per_1x128:
        return per_1x128
    if quant_type == QuantType.per_1x32:
        return per_1x32
    raise ValueError(f"get_hip_quant: {quant_type!r} is not provided by mori-suite (per_1x128 and per_1x32 are)")
