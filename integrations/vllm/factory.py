"""Build the prepare/finalize of one MoE layer for ``all2all_backend="mori_ep"``.

Called from vLLM's ``maybe_make_prepare_finalize`` (hooked by the plugin) with the layer's
``FusedMoEConfig`` and quant config; every refusal is a ValueError that names the setting
and what to use instead.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from vllm.logger import init_logger

from mori_integrations.vllm.all2all import MoriEpAll2AllManager
from mori_integrations.vllm.dispatch_quant import plan_dispatch_quant
from mori_integrations.vllm.mori_utils import ENV_FP8_DISPATCH, use_fp8_dispatch_from_env
from mori_integrations.vllm.prepare_finalize import MoriPrepareAndFinalize
from mori_integrations.vllm.token_exchange import MoriEpTokenExchange

BACKEND_NAME = "mori_ep"

logger = init_logger(__name__)


def make_mori_prepare_finalize(
    moe: Any,
    quant_config: Any,
    routing_tables: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    use_monolithic: bool = False,
    all2all_manager: Optional[Any] = None,
) -> MoriPrepareAndFinalize:
    """Create the :class:`MoriPrepareAndFinalize` of a layer.

    Args:
        moe: the layer's ``FusedMoEConfig``.
        quant_config: the layer's ``FusedMoEQuantConfig`` (None = unquantised).
        routing_tables: vLLM's round-robin routing tables (refused: MORI places experts linearly).
        use_monolithic: whether the chosen experts are monolithic (refused).
        all2all_manager: the EP group's manager; default: the current EP group's.
    """
    from vllm.platforms import current_platform

    parallel = moe.moe_parallel_config
    if use_monolithic:
        raise ValueError(
            f"all2all_backend='{BACKEND_NAME}' needs modular experts, but this layer's MoE backend is "
            "monolithic (router fused into the experts); pick another one, e.g. --moe-backend triton"
        )
    if parallel.enable_eplb:
        raise ValueError(f"all2all_backend='{BACKEND_NAME}' does not support --enable-eplb (expert load balancing)")
    if routing_tables is not None:
        raise ValueError(
            f"all2all_backend='{BACKEND_NAME}' places experts linearly (expert e on rank e // experts_per_rank); "
            "round-robin expert placement is not supported"
        )
    if all2all_manager is None:
        from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager

        all2all_manager = get_ep_all2all_manager()
    if not isinstance(all2all_manager, MoriEpAll2AllManager):
        raise RuntimeError(
            f"all2all_backend='{BACKEND_NAME}' but the EP group's all2all manager is "
            f"{type(all2all_manager).__name__}: the mori-suite vLLM plugin did not run in this process "
            "(check that VLLM_PLUGINS, if set, includes 'mori_suite_ep')"
        )
    world = all2all_manager.world_size
    if moe.num_local_experts * world != moe.num_experts:
        raise ValueError(
            f"all2all_backend='{BACKEND_NAME}' needs the {moe.num_experts} experts split evenly over {world} EP "
            f"ranks, got {moe.num_local_experts} per rank"
        )

    plan = plan_dispatch_quant(quant_config, moe.hidden_dim, current_platform.fp8_dtype())
    transport_fp8 = use_fp8_dispatch_from_env()
    # FP8 transport of unquantised tokens (also when the experts defer quantisation at run
    # time) rides in the operator's scale slots: per token, or per block when the quant
    # config already asks for block scales.
    scale_dim = plan.scale_dim or (1 if transport_fp8 else 0)
    op = all2all_manager.get_handle(
        dict(
            rank=all2all_manager.rank,
            world_size=world,
            hidden_dim=moe.hidden_dim,
            dispatch_dtype=plan.dispatch_dtype or moe.in_dtype,
            activation_dtype=moe.in_dtype,
            scale_dim=scale_dim,
            max_num_tokens_per_rank=moe.max_num_tokens,
            num_local_experts=moe.num_local_experts,
            num_experts_per_token=moe.experts_per_token,
        )
    )
    exchange = MoriEpTokenExchange(
        op,
        rank=all2all_manager.rank,
        num_local_experts=moe.num_local_experts,
        transport_fp8=transport_fp8,
        transport_groups=scale_dim if transport_fp8 else 1,
    )
    if transport_fp8:
        logger.info_once(
            "mori_ep: %s=1, unquantised tokens travel as FP8 with %d scale(s) per token", ENV_FP8_DISPATCH, scale_dim
        )
    batched = wants_batched_layout(moe)
    if batched:
        from mori_core.ops.config import IMPLEMENTED_KERNEL_TYPES, normalize_kernel_type

        kernel = normalize_kernel_type(op.config.kernel_type)
        if kernel not in IMPLEMENTED_KERNEL_TYPES:
            raise ValueError(
                f"all2all_backend='{BACKEND_NAME}': batched experts use MORI's standard-MoE layout, which the "
                f"IntraNode kernels implement; this EP group runs {kernel.name} (it spans nodes). Use standard "
                "experts (e.g. --moe-backend triton, VLLM_MORI_EP_BATCHED_EXPERTS unset)"
            )
        logger.info_once("mori_ep: batched experts, tokens dispatched into the standard-MoE (3-D) layout")
    return MoriPrepareAndFinalize(
        exchange,
        max_tokens_per_rank=moe.max_num_tokens,
        num_dispatchers=world,
        quant_plan=plan,
        batched=batched,
    )


def wants_batched_layout(moe: Any) -> bool:
    """Whether vLLM picks batched experts for this layer (the oracles' own test): the parallel
    config asks for the batched activation format (with VLLM_MORI_EP_BATCHED_EXPERTS=1 for
    mori_ep), or the unquantized MoE backend is ``batched_triton``."""
    return bool(getattr(moe.moe_parallel_config, "use_batched_activation_format", False)) or (
        getattr(moe, "moe_backend", None) == "batched_triton"
    )
