"""``MoriPrepareAndFinalize``: vLLM's modular-kernel prepare/finalize over MORI-EP.

prepare: (optionally) apply the router weight to the input, quantise as the experts'
quant config asks, dispatch each token to the ranks owning its experts, and hand the
experts the received rows with their dispatched (global) top-k ids and weights.
finalize: reduce per-(token, k) outputs when the experts leave that to finalize, then
combine with this rank's pre-dispatch ids and write this rank's ``[M, H]`` output.
The combine sums over ranks, so the output is already reduced (``output_is_reduced``).

Batched experts (``FusedMoEActivationFormat.BatchedExperts``, e.g. ``BatchedTritonExperts``,
chosen by vLLM for ``--moe-backend batched_triton`` or with ``VLLM_MORI_EP_BATCHED_EXPERTS=1``):
prepare dispatches straight into MORI's standard-MoE layout (``dispatch_standard_moe``:
``[local experts, world * max_tokens, H]`` plus per-expert counts) and finalize combines that
layout with the gating weights applied inside the combine (``combine_standard_moe``), as
DeepEP low-latency does. No host synchronisation on this path.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)

from mori_integrations.vllm.dispatch_quant import DispatchQuantPlan, QuantStage, quantize_activations
from mori_integrations.vllm.token_exchange import BatchedTokens, MoriEpTokenExchange, ReceivedTokens

# Weight-and-reduce implementations finalize knows how to honour.
_REDUCED_BY_EXPERTS = (TopKWeightAndReduceNoOP,)
_REDUCED_BY_FINALIZE = (TopKWeightAndReduceDelegate, TopKWeightAndReduceContiguous)
# What a dispatch of the exchange returns (flat ``ReceivedTokens`` or ``BatchedTokens``).
_Received = TypeVar("_Received", ReceivedTokens, BatchedTokens)


class MoriPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """Prepare/finalize for ``all2all_backend="mori_ep"`` (Standard activation format).

    Args:
        exchange: the layer's token exchange over its MORI-EP operator.
        max_tokens_per_rank: most tokens a rank passes to one forward of this layer.
        num_dispatchers: EP group size.
        quant_plan: where activation quantisation happens (see ``dispatch_quant``).
        batched: hand the experts the batched layout (``BatchedExperts`` format) instead of
            flat received rows.
    """

    def __init__(
        self,
        exchange: MoriEpTokenExchange,
        max_tokens_per_rank: int,
        num_dispatchers: int,
        quant_plan: DispatchQuantPlan,
        batched: bool = False,
    ) -> None:
        super().__init__()
        self.exchange = exchange
        self._max_tokens_per_rank = int(max_tokens_per_rank)
        self._num_dispatchers = int(num_dispatchers)
        self.quant_plan = quant_plan
        self.batched = bool(batched)
        self._received: Optional[ReceivedTokens] = None

    # ------------------------------------------------------------------ static properties
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        """Flat ``[received tokens, hidden]`` rows for standard experts, or the batched
        ``[local experts, world * max_tokens, hidden]`` layout for batched experts."""
        if self.batched:
            return mk.FusedMoEActivationFormat.BatchedExperts
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        """MORI routes with int32 expert ids."""
        return torch.int32

    def max_num_tokens_per_rank(self) -> Optional[int]:
        """Capacity of the EP operator per rank and forward."""
        return self._max_tokens_per_rank

    def num_dispatchers(self) -> int:
        """EP group size."""
        return self._num_dispatchers

    def output_is_reduced(self) -> bool:
        """Combine sums the partial results of every rank: no all-reduce afterwards."""
        return True

    def supports_async(self) -> bool:
        """Dispatch/combine are synchronous calls (no DBO / shared-expert overlap)."""
        return False

    def post_init_setup(self, fused_experts: "mk.FusedMoEExperts") -> None:
        """Refuse experts whose input/output contract mori_ep cannot meet, with the reason."""
        check_experts_compatible(fused_experts, batched=self.batched)

    # ------------------------------------------------------------------ prepare
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: Optional[torch.Tensor],
        apply_router_weight_on_input: bool,
        quant_config: Any,
        defer_input_quant: bool = False,
    ) -> mk.PrepareResultType:
        """Quantise (unless deferred), dispatch, and return the received rows.

        Returns ``(a1q [R, H], a1q_scale, None, topk_ids [R, k] int32, topk_weights [R, k])``
        where the ids are global and include experts of other ranks; the experts' ``expert_map``
        masks those out.
        """
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError(
                    "apply_router_weight_on_input needs top-k == 1 (the weight scales the whole token), "
                    f"got top-k {topk_ids.shape[1]}"
                )
            a1 = a1 * topk_weights.to(a1.dtype)
        stage = QuantStage.NONE if defer_input_quant else self.quant_plan.stage
        if self.batched:
            weights = None if apply_router_weight_on_input else topk_weights  # None: combine weighs by 1
            return self._prepare_batched(a1, weights, topk_ids, quant_config, stage)
        received, a1q_scale = self._quantize_and_dispatch(
            self.exchange.dispatch, a1, topk_weights, topk_ids, quant_config, stage
        )
        a1q = received.hidden_states
        if stage is QuantStage.AFTER_DISPATCH:
            a1q, a1q_scale = quantize_activations(received.hidden_states, quant_config, self.quant_plan)
        self._received = received
        return a1q, a1q_scale, None, received.topk_ids, received.topk_weights

    def _quantize_and_dispatch(
        self,
        dispatch: Callable[..., _Received],
        a1: torch.Tensor,
        weights: Optional[torch.Tensor],
        topk_ids: torch.Tensor,
        quant_config: Any,
        stage: QuantStage,
    ) -> tuple[_Received, Optional[torch.Tensor]]:
        """Quantise ``a1`` where ``stage`` is before the dispatch, then ``dispatch`` it (the
        exchange's flat or batched dispatch). Returns what arrived and the scales of the received
        rows: the dispatched per-token scales, the static tensor scale, or None (unquantised
        rows, also for quantisation after the dispatch, which is the caller's)."""
        plan = self.quant_plan
        if stage is QuantStage.BEFORE_DISPATCH:
            a1q, scales = quantize_activations(a1, quant_config, plan)
            received = dispatch(a1q, weights, topk_ids, scales.reshape(a1q.shape[0], plan.scale_dim))
            return received, received.scales
        if stage is QuantStage.STATIC_TENSOR:
            a1q, scale = quantize_activations(a1, quant_config, plan)
            return dispatch(a1q, weights, topk_ids), scale
        return dispatch(a1, weights, topk_ids), None

    def _prepare_batched(
        self,
        a1: torch.Tensor,
        weights: Optional[torch.Tensor],
        topk_ids: torch.Tensor,
        quant_config: Any,
        stage: QuantStage,
    ) -> mk.PrepareResultType:
        """Batched-layout prepare: ``(x [E, T, H], scales, ExpertTokensMetadata(counts), None, None)``."""
        received, scale = self._quantize_and_dispatch(
            self.exchange.dispatch_batched, a1, weights, topk_ids, quant_config, stage
        )
        x = received.hidden_states
        if stage is QuantStage.AFTER_DISPATCH:
            x, scale = _quantize_received_batched(received, quant_config, self.quant_plan)
        meta = mk.ExpertTokensMetadata(expert_num_tokens=received.expert_num_tokens, expert_num_tokens_cpu=None)
        return x, scale, meta, None, None

    # ------------------------------------------------------------------ finalize
    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        """Weight-and-reduce if the experts left it here, then combine into ``output``.

        ``topk_ids``/``topk_weights`` are the *dispatched* ones (vLLM rebinds them after
        prepare); combine uses this rank's own routing kept by the exchange instead.
        """
        if self.batched:
            if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
                raise ValueError(
                    f"all2all_backend='mori_ep' with batched experts applies the gating weights in the combine; "
                    f"got {type(weight_and_reduce_impl).__name__}, expected TopKWeightAndReduceDelegate"
                )
            self.exchange.combine_batched(fused_expert_output, out=output)
            return
        received = self._received
        if received is None:
            raise RuntimeError("finalize() without a preceding prepare() on this layer")
        self._received = None
        rows = fused_expert_output
        if isinstance(weight_and_reduce_impl, _REDUCED_BY_FINALIZE):
            rows = self.exchange.weight_and_reduce(
                fused_expert_output, received, apply_weights=not apply_router_weight_on_input
            )
        elif not isinstance(weight_and_reduce_impl, _REDUCED_BY_EXPERTS):
            raise ValueError(
                f"all2all_backend='mori_ep' cannot apply {type(weight_and_reduce_impl).__name__}; "
                "supported: experts that reduce themselves (TopKWeightAndReduceNoOP) or leave a "
                "[tokens, topk, hidden] output to finalize (Delegate / Contiguous)"
            )
        rows = rows.reshape(received.num_tokens, output.shape[1])
        self.exchange.combine(rows, out=output)


def _quantize_received_batched(received: BatchedTokens, quant_config: Any, plan: DispatchQuantPlan) -> tuple:
    """Dynamic per-tensor FP8 over the rows this rank received (rows past the counts masked to 0)."""
    x = received.hidden_states
    e, t, h = x.shape
    valid = torch.arange(t, device=x.device).unsqueeze(0) < received.expert_num_tokens.to(x.device).unsqueeze(1)
    masked = torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    q, scale = quantize_activations(masked.reshape(e * t, h), quant_config, plan)
    return q.view(e, t, h), scale


def check_experts_compatible(fused_experts: Any, batched: bool = False) -> None:
    """Raise ValueError when ``fused_experts`` cannot run behind mori_ep, naming the reason.

    Standard layout: mori_ep hands the experts what DeepEP high-throughput hands them --
    Standard-format rows of received tokens with *global* top-k ids (experts of other ranks
    included) and the layer's ``expert_map`` -- so experts that vLLM refuses behind DeepEP HT
    are refused here, as are experts that ignore ``expert_map`` and monolithic (router-fused)
    experts. Batched layout: what DeepEP low-latency hands them (per-expert rows and counts;
    weights applied in the combine), so batched experts vLLM refuses behind DeepEP LL are refused.
    """
    name = type(fused_experts).__name__
    hint = "choose experts that honour expert_map, e.g. --moe-backend triton"
    if fused_experts.is_monolithic():
        raise ValueError(f"all2all_backend='mori_ep' needs modular experts; {name} is monolithic ({hint})")
    fmt = fused_experts.activation_format()
    if batched:
        _check_batched_experts(fused_experts, name, fmt)
        return
    if fmt != mk.FusedMoEActivationFormat.Standard:
        raise ValueError(
            f"all2all_backend='mori_ep' needs Standard-format experts here; {name} is batched ({hint}; the batched "
            "layout is used when vLLM selects batched experts: --moe-backend batched_triton or "
            "VLLM_MORI_EP_BATCHED_EXPERTS=1)"
        )
    supports_map = getattr(fused_experts, "supports_expert_map", None)
    if type(fused_experts).__module__.endswith(".experts.cpu_moe") or (callable(supports_map) and not supports_map()):
        raise ValueError(
            f"all2all_backend='mori_ep': {name} ignores expert_map, so it would compute other ranks' "
            f"experts with this rank's weights ({hint})"
        )
    if _refused_behind(fused_experts, "deepep_high_throughput"):
        raise ValueError(
            f"all2all_backend='mori_ep': {name} does not take dispatched tokens with global expert "
            f"ids (vLLM refuses it behind DeepEP high-throughput for the same reason; {hint})"
        )
    impl = fused_experts.finalize_weight_and_reduce_impl()
    if not isinstance(impl, _REDUCED_BY_EXPERTS + _REDUCED_BY_FINALIZE):
        raise ValueError(
            f"all2all_backend='mori_ep': {name} asks finalize for {type(impl).__name__}, which needs a "
            "batched layout; mori_ep supports NoOP / Delegate / Contiguous weight-and-reduce"
        )


def _check_batched_experts(fused_experts: Any, name: str, fmt: Any) -> None:
    """The batched-layout half of :func:`check_experts_compatible`."""
    if fmt != mk.FusedMoEActivationFormat.BatchedExperts:
        raise ValueError(
            f"all2all_backend='mori_ep' is in batched layout for this layer but {name} takes Standard-format rows"
        )
    if _refused_behind(fused_experts, "deepep_low_latency"):
        raise ValueError(
            f"all2all_backend='mori_ep' (batched layout): {name} does not take DeepEP-low-latency-style batched "
            "tokens (vLLM refuses it behind DeepEP low-latency for the same reason)"
        )
    impl = fused_experts.finalize_weight_and_reduce_impl()
    if not isinstance(impl, TopKWeightAndReduceDelegate):
        raise ValueError(
            f"all2all_backend='mori_ep' (batched layout) applies the gating weights in the combine; {name} asks "
            f"finalize for {type(impl).__name__}"
        )


def _refused_behind(fused_experts: Any, all2all_backend: str) -> bool:
    """Whether vLLM's own check refuses ``fused_experts`` behind ``all2all_backend`` (the DeepEP
    mode whose tokens mori_ep hands the experts in this layout). False when the layer's parallel
    config is not a dataclass that can be re-targeted to that backend."""
    import dataclasses

    parallel = fused_experts.moe_config.moe_parallel_config
    if not dataclasses.is_dataclass(parallel):
        return False
    as_deepep = dataclasses.replace(parallel, all2all_backend=all2all_backend)
    return not type(fused_experts)._supports_parallel_config(as_deepep)
