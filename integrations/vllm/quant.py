"""Portable FP8 (e4m3) quantisation of token rows, in plain torch.

Used for FP8 *transport* (quantise before dispatch, dequantise after, when
``VLLM_MORI_EP_USE_FP8_DISPATCH=1`` and the experts want unquantised input), and as the
CPU stand-in for vLLM's CUDA quantisation kernels when the quant config asks for FP8
activations. Scales are float32, one per row (``groups=1``) or one per equal group of
channels, laid out ``[rows, groups]`` row-major -- the layout vLLM's
``moe_kernel_quantize_input`` produces for per-token and 1x128-block activations.

No vLLM import (the GPU check uses it on machines without vLLM).
"""

from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn

# Smallest scale, so an all-zero row quantises to zeros instead of dividing by zero.
_MIN_SCALE = 1e-10


def fp8_max(dtype: torch.dtype = FP8_DTYPE) -> float:
    """Largest finite value of an FP8 dtype."""
    return float(torch.finfo(dtype).max)


def quantize_rows(
    x: torch.Tensor, groups: int = 1, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric quantisation with one scale per row group.

    Args:
        x: ``[rows, hidden]`` floating-point tensor.
        groups: scales per row; must divide ``hidden`` (1 = per token, hidden/128 = 1x128 blocks).
        dtype: FP8 dtype of the result.

    Returns:
        ``(q [rows, hidden] dtype, scales [rows, groups] float32)`` with ``x ~= q * scale``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, hidden], got shape {tuple(x.shape)}")
    rows, hidden = x.shape
    if groups < 1 or hidden % groups:
        raise ValueError(f"groups={groups} must be >= 1 and divide hidden={hidden}")
    xg = x.to(torch.float32).view(rows, groups, hidden // groups)
    amax = xg.abs().amax(dim=-1)
    scales = (amax / fp8_max(dtype)).clamp_min(_MIN_SCALE)
    q = (xg / scales.unsqueeze(-1)).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return q.view(rows, hidden), scales.contiguous()


def quantize_static(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> torch.Tensor:
    """Quantise ``x`` with one given per-tensor ``scale`` (static activation scale)."""
    if scale.numel() != 1:
        raise ValueError(f"a static per-tensor scale has one element, got shape {tuple(scale.shape)}")
    s = scale.to(device=x.device, dtype=torch.float32).reshape(())
    return (x.to(torch.float32) / s).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` (scales ``[rows, groups]``, or one per-tensor value)."""
    rows, hidden = q.shape
    x = q.to(torch.float32)
    if scales.numel() == 1:
        return (x * scales.to(torch.float32).reshape(())).to(out_dtype)
    groups = scales.shape[-1]
    x = x.view(rows, groups, hidden // groups) * scales.to(torch.float32).view(rows, groups, 1)
    return x.view(rows, hidden).to(out_dtype)


def quantize_dequantize_rows(x: torch.Tensor, groups: int = 1, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """What FP8 transport does to a token row: quantise then dequantise back to ``x.dtype``."""
    q, s = quantize_rows(x, groups, dtype or FP8_DTYPE)
    return dequantize_rows(q, s, x.dtype)
