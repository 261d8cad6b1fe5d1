"""Where activation quantisation happens relative to the MORI-EP dispatch.

vLLM's quant config says what the experts expect (``quant_dtype``, per-token / per-tensor /
block scales). MORI's dispatch carries per-token scale rows, so a scheme whose scales are
per token or per 1xN block is quantised *before* dispatch (FP8 bytes travel, scales ride in
the operator's scale slots); a static per-tensor scale is the same on every rank, so it
stays home; a dynamic per-tensor scale is computed *after* dispatch over the tokens this
rank's experts process. Everything else is refused with an error naming the scheme.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mori_integrations.vllm import quant

SUPPORTED_SCHEMES = (
    "unquantized activations (bf16/fp16/fp32, incl. weight-only quantisation)",
    "FP8 e4m3 dynamic per-token activations",
    "FP8 e4m3 dynamic 1xN-block activations (e.g. DeepSeek 1x128)",
    "FP8 e4m3 static per-tensor activations",
    "FP8 e4m3 dynamic per-tensor activations (quantised after dispatch)",
)


class QuantStage(enum.Enum):
    """When the prepare step quantises the activations."""

    NONE = "none"  # dispatch the activations unchanged
    BEFORE_DISPATCH = "before_dispatch"  # per-token / block scales travel with the tokens
    STATIC_TENSOR = "static_tensor"  # quantise with the static scale; the scale stays home
    AFTER_DISPATCH = "after_dispatch"  # dynamic per-tensor scale over the received tokens


@dataclass(frozen=True)
class DispatchQuantPlan:
    """How one layer's activations are quantised around dispatch.

    Attributes:
        stage: see :class:`QuantStage`.
        scale_dim: float32 scales per dispatched token for ``BEFORE_DISPATCH`` (else 0).
        dispatch_dtype: dtype of the dispatched rows for the quantised stages (else None).
    """

    stage: QuantStage
    scale_dim: int = 0
    dispatch_dtype: Optional[torch.dtype] = None


def plan_dispatch_quant(quant_config: Any, hidden_dim: int, fp8_dtype: torch.dtype) -> DispatchQuantPlan:
    """Map a vLLM ``FusedMoEQuantConfig`` (or None) to a :class:`DispatchQuantPlan`.

    Raises:
        ValueError: for activation schemes mori_ep does not carry, naming the scheme and
            listing the supported ones.
    """
    if quant_config is None or quant_config.quant_dtype is None:
        return DispatchQuantPlan(QuantStage.NONE)
    qdtype = quant_config.quant_dtype
    if qdtype != fp8_dtype:
        raise ValueError(
            f"all2all_backend='mori_ep' does not support activation quantisation {qdtype!r}; "
            f"supported: {'; '.join(SUPPORTED_SCHEMES)}"
        )
    if quant_config.is_block_quantized:
        block_k = int(quant_config.block_shape[1])
        if block_k < 1 or hidden_dim % block_k:
            raise ValueError(
                f"all2all_backend='mori_ep': block size {block_k} of block_shape {quant_config.block_shape} "
                f"must divide hidden_dim={hidden_dim}"
            )
        return DispatchQuantPlan(QuantStage.BEFORE_DISPATCH, hidden_dim // block_k, fp8_dtype)
    if quant_config.is_per_act_token:
        return DispatchQuantPlan(QuantStage.BEFORE_DISPATCH, 1, fp8_dtype)
    a1_scale = quant_config.a1_scale
    if a1_scale is not None:
        if a1_scale.numel() != 1:
            raise ValueError(
                "all2all_backend='mori_ep': a static activation scale must be one per-tensor value, "
                f"got shape {tuple(a1_scale.shape)}"
            )
        return DispatchQuantPlan(QuantStage.STATIC_TENSOR, 0, fp8_dtype)
    return DispatchQuantPlan(QuantStage.AFTER_DISPATCH, 0, fp8_dtype)


def quantize_activations(
    x: torch.Tensor, quant_config: Any, plan: DispatchQuantPlan
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantise ``x`` the way the experts of ``quant_config`` expect.

    On CUDA this is vLLM's own ``moe_kernel_quantize_input`` (the kernels every other
    prepare/finalize uses, so the scale format matches the experts exactly); elsewhere the
    portable torch implementation in :mod:`mori_integrations.vllm.quant` produces the same
    layout (vLLM's FP8 quantisation kernels are CUDA-only).

    Returns:
        ``(q, scales)``: per-token ``[M, 1]`` / block ``[M, H/N]`` scales, or the per-tensor
        scale (one element).
    """
    if plan.stage is QuantStage.NONE:
        return x, None
    if x.shape[0] == 0:  # ranks without tokens still take part in every dispatch
        q = torch.empty(x.shape, dtype=plan.dispatch_dtype, device=x.device)
        if plan.stage is QuantStage.STATIC_TENSOR:
            return q, quant_config.a1_scale
        if plan.stage is QuantStage.AFTER_DISPATCH:
            return q, torch.ones(1, dtype=torch.float32, device=x.device)
        return q, torch.empty(0, plan.scale_dim, dtype=torch.float32, device=x.device)
    if x.is_cuda:
        from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

        return moe_kernel_quantize_input(
            x,
            quant_config.a1_scale,
            quant_config.quant_dtype,
            quant_config.per_act_token_quant,
            quant_config.block_shape,
        )
    if plan.stage is QuantStage.STATIC_TENSOR:
        scale = quant_config.a1_scale
        return quant.quantize_static(x, scale, plan.dispatch_dtype), scale
    if plan.stage is QuantStage.AFTER_DISPATCH:
        q, s = quant.quantize_rows(x.reshape(1, -1), 1, plan.dispatch_dtype)
        return q.view_as(x), s.view(1)
    return quant.quantize_rows(x, plan.scale_dim, plan.dispatch_dtype)
