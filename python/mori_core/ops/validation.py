"""Argument checks shared by the GPU op and the reference op.

Every error names the argument, what was expected and the limit, and is raised before any
data moves (so a rejected call changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mori_core.ops.config import EpDispatchCombineConfig

# Dtypes dispatch can carry (dispatch moves bytes, so any 1/2/4-byte float works).
DISPATCH_DTYPES = tuple(
    dt
    for dt in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2", None),
    )
    if dt is not None
)
# Dtypes combine accumulates (fp32 accumulation, result in the input dtype).
COMBINE_DTYPES = (torch.bfloat16, torch.float32)
# The kernels' combine dtype codes (EpHandle::Combine: 0 = bf16, 1 = fp32).
COMBINE_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1}


@dataclass(frozen=True)
class DispatchArgs:
    """What dispatch learned from its arguments."""

    num_tokens: int
    hidden_dim: int
    has_weights: bool
    has_scales: bool


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _require_layout(name: str, t: torch.Tensor, device: Optional[torch.device]) -> None:
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def check_launch_overrides(block_num: int, rdma_block_num: int, warp_per_block: int) -> None:
    """Per-call launch overrides: -1 (or 0) keeps the configured value, positive values override."""
    for name, v in (("block_num", block_num), ("rdma_block_num", rdma_block_num), ("warp_per_block", warp_per_block)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {v!r}")
        if v < -1:
            raise ValueError(f"{name} must be -1 (use the config) or >= 0, got {v}")


def check_dispatch_args(
    config: EpDispatchCombineConfig,
    input: torch.Tensor,
    weights: Optional[torch.Tensor],
    scales: Optional[torch.Tensor],
    indices: torch.Tensor,
    device: Optional[torch.device] = None,
    allowed_dtypes: tuple = DISPATCH_DTYPES,
) -> DispatchArgs:
    """Validate dispatch's tensors against the config; ``device=None`` accepts any one device."""
    input = _require_tensor("input", input)
    if device is None:
        device = input.device
    if input.dim() != 2:
        raise ValueError(f"input must be 2-D [num_tokens, hidden_dim], got shape {tuple(input.shape)}")
    n, h = int(input.shape[0]), int(input.shape[1])
    if n > config.max_num_inp_token_per_rank:
        raise ValueError(
            f"input has {n} tokens, more than max_num_inp_token_per_rank={config.max_num_inp_token_per_rank}"
        )
    check_rows(input, h, config, allowed_dtypes, device)
    topk = config.num_experts_per_token
    indices = _check_indices(
        indices, (n, topk), device, dtype_hint=" (MORI's top-k id dtype)",
        shape_hint=f"must have shape [num_tokens={n}, num_experts_per_token={topk}]",
    )

    has_weights = weights is not None
    if weights is not None:
        weights = _require_tensor("weights", weights)
        if weights.dtype != torch.float32:
            raise ValueError(f"weights must be torch.float32, got {weights.dtype}")
        if tuple(weights.shape) != (n, topk):
            raise ValueError(
                f"weights must have shape [num_tokens={n}, num_experts_per_token={topk}], got {tuple(weights.shape)}"
            )
        _require_layout("weights", weights, device)

    has_scales = False
    if scales is not None and config.scale_dim > 0:
        scales = _require_tensor("scales", scales)
        if tuple(scales.shape) != (n, config.scale_dim):
            raise ValueError(
                f"scales must have shape [num_tokens={n}, scale_dim={config.scale_dim}], got {tuple(scales.shape)}"
            )
        if scales.element_size() != config.scale_type_size:
            raise ValueError(
                f"scales dtype {scales.dtype} has {scales.element_size()} bytes per element, "
                f"config.scale_type_size={config.scale_type_size}"
            )
        _require_layout("scales", scales, device)
        has_scales = True
    elif scales is not None and isinstance(scales, torch.Tensor) and scales.numel() > 0:
        raise ValueError(f"scales has {scales.numel()} elements but config.scale_dim=0; pass None or an empty tensor")
    return DispatchArgs(num_tokens=n, hidden_dim=h, has_weights=has_weights, has_scales=has_scales)


def check_combine_args(
    config: EpDispatchCombineConfig,
    input: torch.Tensor,
    weights: Optional[torch.Tensor],
    indices: torch.Tensor,
    dispatched_tokens: int,
    device: Optional[torch.device] = None,
    allowed_dtypes: tuple = COMBINE_DTYPES,
) -> bool:
    """Validate combine's tensors; returns whether weights are to be combined.

    ``indices`` must be this rank's own routing given to the preceding dispatch (same token
    count); ``input``/``weights`` rows are in dispatch-output order. Row counts against the
    number of received tokens are checked where that number is known (the reference op on the
    host, the GPU kernels on the device).
    """
    input = _require_tensor("input", input)
    if device is None:
        device = input.device
    if input.dim() != 2:
        raise ValueError(f"input must be 2-D [rows, hidden_dim], got shape {tuple(input.shape)}")
    h = int(input.shape[1])
    check_rows(input, h, config, allowed_dtypes, device, dtype_label="combine input")
    topk = config.num_experts_per_token
    indices = _check_indices(
        indices, (dispatched_tokens, topk), device, dtype_hint="",
        shape_hint=f"must be this rank's own routing passed to dispatch, shape [{dispatched_tokens}, {topk}];",
    )

    if weights is None or weights.numel() == 0:
        return False
    weights = _require_tensor("weights", weights)
    if weights.dtype != torch.float32:
        raise ValueError(f"weights must be torch.float32, got {weights.dtype}")
    if weights.dim() != 2 or weights.shape[1] != topk:
        raise ValueError(f"weights must have shape [rows, num_experts_per_token={topk}], got {tuple(weights.shape)}")
    _require_layout("weights", weights, device)
    return True


def resolve_combine_mode(config: EpDispatchCombineConfig, use_external_inp_buf: int) -> bool:
    """True = push (copy ``input`` rows), False = pull (zero-copy from the registered buffer)."""
    if isinstance(use_external_inp_buf, bool):
        return use_external_inp_buf
    if use_external_inp_buf not in (-1, 0, 1):
        raise ValueError(f"use_external_inp_buf must be -1 (config), 0 (zero-copy) or 1 (push), got {use_external_inp_buf}")
    return bool(config.use_external_inp_buf) if use_external_inp_buf < 0 else bool(use_external_inp_buf)


def check_rows(
    rows: torch.Tensor,
    h: int,
    config: EpDispatchCombineConfig,
    allowed_dtypes: tuple,
    device: Optional[torch.device],
    name: str = "input",
    dtype_label: Optional[str] = None,
) -> None:
    """Hidden size ``h``, dtype, element size, device and layout of a tensor of token rows (2-D
    rows or the 3-D standard-MoE layout). Errors name ``name`` (the dtype error ``dtype_label``,
    default ``name``); ``device=None`` accepts any device."""
    if not 1 <= h <= config.hidden_dim:
        raise ValueError(f"{name} hidden size {h} must be in [1, hidden_dim={config.hidden_dim}]")
    if rows.dtype not in allowed_dtypes:
        label = name if dtype_label is None else dtype_label
        raise ValueError(f"{label} dtype {rows.dtype} is not supported; use one of {list(allowed_dtypes)}")
    if rows.element_size() > config.max_token_type_size:
        raise ValueError(
            f"{name} dtype {rows.dtype} has {rows.element_size()} bytes per element, more than "
            f"max_token_type_size={config.max_token_type_size}"
        )
    _require_layout(name, rows, device)


def _check_indices(indices, shape: tuple, device, dtype_hint: str, shape_hint: str) -> torch.Tensor:
    """int32 top-k ids of the given shape and layout; returns the checked tensor."""
    indices = _require_tensor("indices", indices)
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be torch.int32{dtype_hint}, got {indices.dtype}")
    if tuple(indices.shape) != shape:
        sep = "" if shape_hint.endswith(";") else ","
        raise ValueError(f"indices {shape_hint}{sep} got {tuple(indices.shape)}")
    _require_layout("indices", indices, device)
    return indices
