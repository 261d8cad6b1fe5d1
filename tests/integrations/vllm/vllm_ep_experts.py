"""A plain-torch experts implementation behind vLLM's modular-kernel interface.

It is the *other side* of the prepare/finalize under test: it consumes exactly what a
Standard-format vLLM expert receives (received rows, global top-k ids, ``expert_map``,
optional FP8 activations with scales) and produces either one weighted row per token
(like TritonExperts: ``TopKWeightAndReduceNoOP``) or unweighted per-(token, k) rows that
finalize must reduce (``TopKWeightAndReduceDelegate``). In the second mode the rows of other
ranks' experts are filled with NaN, so a finalize that forgets to mask them fails loudly.
:class:`TorchBatchedExperts` consumes what a BatchedExperts-format expert receives (like
BatchedTritonExperts): ``[local experts, max_tokens, K]`` rows with per-expert counts; rows past
a count are left NaN, so a combine that reads them fails loudly.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)

from mori_integrations.vllm import quant
from vllm_ep_reference import expert_ffn


def dequantize_activations(x: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """FP8 rows back to float32 with per-token / per-block / per-tensor scales."""
    if x.dtype.itemsize > 1:
        return x.to(torch.float32)
    assert scale is not None, "FP8 activations arrived without scales"
    if scale.numel() == 1:
        return x.to(torch.float32) * scale.to(torch.float32).reshape(())
    return quant.dequantize_rows(x, scale.reshape(x.shape[0], -1), torch.float32)


@dataclass(frozen=True)
class ExpertInputs:
    """What ``FusedMoEExpertsModular.apply`` hands these experts (the arguments they use)."""

    hidden_states: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: Optional[torch.Tensor]
    a1q_scale: Optional[torch.Tensor]
    expert_tokens_meta: Optional[mk.ExpertTokensMetadata]
    apply_router_weight_on_input: bool


class _TorchExpertsBase(mk.FusedMoEExpertsModular):
    """vLLM's experts interface, written out once: the support predicates vLLM's oracles query
    (these reference experts take any scheme), and ``workspace_shapes`` / ``apply`` with vLLM's
    signatures, which hand over to :meth:`_output_shape` / :meth:`_compute` of each layout."""

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:  # noqa: ANN001 - vLLM signature
        return True

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:  # noqa: ANN001 - vLLM signature
        return True

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
        expert_tokens_meta: Optional[mk.ExpertTokensMetadata],
        activation: MoEActivation,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (0,), (0,), self._output_shape(M, K, topk, local_num_experts)

    @abstractmethod
    def _output_shape(self, M: int, K: int, topk: int, local_num_experts: int) -> tuple[int, ...]:
        """Shape of ``apply``'s output (the third workspace); these experts need no other."""

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: Optional[torch.Tensor],
        a1q_scale: Optional[torch.Tensor],
        a2_scale: Optional[torch.Tensor],
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: Optional[mk.ExpertTokensMetadata],
        apply_router_weight_on_input: bool,
    ) -> None:
        self._compute(
            output,
            ExpertInputs(
                hidden_states, w1, w2, topk_weights, topk_ids, expert_map, a1q_scale, expert_tokens_meta,
                apply_router_weight_on_input,
            ),
        )

    @abstractmethod
    def _compute(self, output: torch.Tensor, inp: ExpertInputs) -> None:
        """Write the experts' result for ``inp`` into ``output``."""


class TorchExperts(_TorchExpertsBase):
    """Reference experts that apply the gating weights and reduce over top-k themselves."""

    reduce_in_finalize = False
    quantize_themselves = False  # expects_unquantized_inputs: quantise per the quant config here

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard


    @property
    def expects_unquantized_inputs(self) -> bool:
        return self.quantize_themselves

    def _output_shape(self, M: int, K: int, topk: int, local_num_experts: int) -> tuple[int, ...]:
        return (M, topk, K) if self.reduce_in_finalize else (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceDelegate() if self.reduce_in_finalize else TopKWeightAndReduceNoOP()

    def _compute(self, output: torch.Tensor, inp: ExpertInputs) -> None:
        expert_map, topk_ids, w2 = inp.expert_map, inp.topk_ids, inp.w2
        hidden_states, a1q_scale = inp.hidden_states, inp.a1q_scale
        assert expert_map is not None, "EP experts need the layer's expert_map"
        if self.quantize_themselves:
            assert hidden_states.dtype.itemsize > 1 and a1q_scale is None, "deferred quantisation got FP8 input"
            hidden_states, a1q_scale = quant.quantize_rows(hidden_states, 1)
        x = dequantize_activations(hidden_states, a1q_scale)
        r, k = topk_ids.shape
        per_slot = torch.full((r, k, w2.shape[1]), float("nan"), dtype=torch.float32, device=x.device)
        for slot in range(k):
            local = expert_map[topk_ids[:, slot].to(torch.int64)]
            for e in torch.unique(local).tolist():
                if e < 0:
                    continue
                rows = torch.nonzero(local == e, as_tuple=True)[0]
                per_slot[rows, slot] = expert_ffn(x[rows], inp.w1[e], w2[e])
        if self.reduce_in_finalize:
            output.copy_(per_slot.reshape(output.shape))
            return
        is_local = expert_map[topk_ids.to(torch.int64)] >= 0
        topk_weights = inp.topk_weights
        w = torch.ones_like(topk_weights) if inp.apply_router_weight_on_input else topk_weights.to(torch.float32)
        contrib = torch.where(is_local.unsqueeze(-1), per_slot * w.unsqueeze(-1), torch.zeros(()))
        output.copy_(contrib.sum(dim=1).to(output.dtype))


class TorchExpertsReducedInFinalize(TorchExperts):
    """Reference experts that leave weight application and the top-k sum to finalize."""

    reduce_in_finalize = True


class TorchExpertsQuantizingThemselves(TorchExperts):
    """Reference experts that take unquantised input and quantise it per token themselves."""

    quantize_themselves = True


class TorchBatchedExperts(_TorchExpertsBase):
    """Reference experts in vLLM's batched format: unweighted outputs per (expert, row); the
    prepare/finalize applies the gating weights in its combine (``TopKWeightAndReduceDelegate``)."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts


    def _output_shape(self, M: int, K: int, topk: int, local_num_experts: int) -> tuple[int, ...]:
        return (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceDelegate()

    def _compute(self, output: torch.Tensor, inp: ExpertInputs) -> None:
        hidden_states, a1q_scale, expert_tokens_meta = inp.hidden_states, inp.a1q_scale, inp.expert_tokens_meta
        assert expert_tokens_meta is not None and expert_tokens_meta.expert_num_tokens is not None
        counts = expert_tokens_meta.expert_num_tokens.tolist()
        e_local, t, k = hidden_states.shape
        assert tuple(output.shape) == (e_local, t, k), (tuple(output.shape), tuple(hidden_states.shape))
        output.fill_(float("nan"))
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = hidden_states[e, :n]
            scale = None
            if a1q_scale is not None:
                scale = a1q_scale if a1q_scale.numel() == 1 else a1q_scale[e, :n]
            x = dequantize_activations(rows, scale)
            output[e, :n] = expert_ffn(x, inp.w1[e], inp.w2[e]).to(output.dtype)
