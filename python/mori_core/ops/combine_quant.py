"""FP8 transport of combine rows (``EpDispatchCombineConfig.quant_type``), in plain torch.

The GPU combine kernels (``mori_core/csrc/ops/ep_quant.cuh``) and the reference op share these
numerics, so CPU tests pin the exact bytes:

* ``"fp8_direct_cast"``: every bf16 value is saturated to +-448 and rounded (nearest, ties to
  even) to float8 e4m3fn; no scale. The receiver adds the e4m3 value.
* ``"fp8_blockwise"``: one float32 scale per 128-channel block: ``scale = amax / 448`` (1 for an
  all-zero block), ``q = e4m3(clamp(x * (1 / scale)))``; the receiver adds ``q * scale``.

Every row the combine moves is quantised, a rank's own rows included (as in MORI, whose own rows
also pass through its staging buffers; it also makes the quantisation testable on one GPU). Each
quantised row occupies the slot of a bf16 row (``2 * hidden`` bytes): ``hidden`` e4m3 bytes, then
``hidden / 128`` float32 scales (blockwise). Accumulation is float32 in ascending source-rank
order, every product rounded on its own, and the sum is rounded once to bf16. Gating-weight rows
are never quantised.
"""

from __future__ import annotations

import torch

from mori_core.ops.config import EpDispatchCombineConfig, EpDispatchCombineQuantType, normalize_quant_type

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128  # channels per fp8_blockwise scale

# EpCombineQuant codes of the compiled core (ops/ep_types.hpp).
_QUANT_CODES = {
    EpDispatchCombineQuantType.None_: 0,
    EpDispatchCombineQuantType.Fp8DirectCast: 1,
    EpDispatchCombineQuantType.Fp8BlockwiseQuant: 2,
}


def combine_quant_code(config: EpDispatchCombineConfig) -> int:
    """The core's EpCombineQuant code of ``config.quant_type`` (0 = none).

    Raises:
        NotImplementedError: for ``"fp4_blockwise"`` (an AMD gfx950-only format in MORI).
    """
    qt = normalize_quant_type(config.quant_type)
    if qt not in _QUANT_CODES:
        raise NotImplementedError(
            f"quant_type={config.quant_type!r} is not implemented; use 'none', 'fp8_direct_cast' or 'fp8_blockwise'"
        )
    return _QUANT_CODES[qt]


def check_quantized_combine(quant: int, dtype: torch.dtype, hidden: int) -> None:
    """Raise ValueError when a combine of ``dtype`` rows of ``hidden`` channels cannot be FP8-quantised."""
    if quant == 0:
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"FP8 combine (quant_type fp8_*) carries bf16 rows; got combine input dtype {dtype}")
    if quant == 2 and hidden % FP8_BLOCK:
        raise ValueError(f"quant_type fp8_blockwise needs a hidden size that is a multiple of {FP8_BLOCK}, got {hidden}")


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def encode_rows(rows: torch.Tensor, quant: int) -> torch.Tensor:
    """Quantise bf16 rows ``[n, hidden]`` into ``[n, 2 * hidden]`` uint8 slots (layout in the module doc)."""
    n, h = rows.shape
    out = torch.zeros(n, 2 * h, dtype=torch.uint8, device=rows.device)
    x = rows.to(torch.float32)
    if quant == 1:
        out[:, :h] = _to_e4m3(x).view(torch.uint8)
        return out
    nb = h // FP8_BLOCK
    blocks = x.view(n, nb, FP8_BLOCK)
    scale, inv = block_scales(blocks.abs().amax(dim=-1))
    q = _to_e4m3(blocks * inv.unsqueeze(-1)).view(n, h)
    out[:, :h] = q.view(torch.uint8)
    out[:, h : h + 4 * nb] = scale.contiguous().view(torch.uint8).view(n, 4 * nb)
    return out


def block_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1 / scale)`` of blocks with maximum magnitude ``amax``, as the kernels compute them.

    Both are correctly rounded float32 divisions (the kernels' ``div.rn`` / ``rcp.rn``). They are
    computed on the CPU: torch's CUDA division by a scalar multiplies by its reciprocal, which
    can differ in the last bit and move a value to the neighbouring e4m3 step."""
    a = amax.detach().to("cpu", torch.float32)
    scale = torch.where(a > 0, a / torch.tensor(FP8_MAX), torch.ones_like(a))
    inv = torch.tensor(1.0) / scale
    return scale.to(amax.device), inv.to(amax.device)


def decode_rows(data: torch.Tensor, hidden: int, quant: int) -> torch.Tensor:
    """float32 ``[n, hidden]`` values a receiver adds for encoded rows ``data`` (``[n, >= 2 * hidden]`` uint8)."""
    n = data.shape[0]
    q = data[:, :hidden].contiguous().view(FP8_DTYPE).to(torch.float32)
    if quant == 1:
        return q
    nb = hidden // FP8_BLOCK
    scale = data[:, hidden : hidden + 4 * nb].contiguous().view(torch.float32).view(n, nb, 1)
    return (q.view(n, nb, FP8_BLOCK) * scale).view(n, hidden)


def link_bytes_per_row(hidden: int, elem_size: int, quant: int) -> int:
    """Bytes one combine row puts on the link (payload + scales; weights not counted)."""
    if quant == 0:
        return hidden * elem_size
    return hidden + (4 * (hidden // FP8_BLOCK) if quant == 2 else 0)
