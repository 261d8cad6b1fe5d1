"""One MoE layer's token round trip over a MORI-EP operator, independent of vLLM.

:class:`MoriEpTokenExchange` is the part of the vLLM prepare/finalize that talks to the
operator: dispatch (with optional FP8 transport), the local weight-and-reduce for experts
that leave it to finalize, and combine with this rank's *pre-dispatch* routing (vLLM's
modular kernel hands finalize the dispatched ids instead; passing those to combine garbles
the output -- vllm-project/vllm#52639). Keeping it free of vLLM lets the GPU check and the
MoE benchmark run the very same code on machines where vLLM is not installed.

MORI semantics this relies on (docs/vllm.md): a token reaches each unique destination rank
once, with its full top-k ids and weights; that rank returns one row per received token in
which it applied the weights of *its* experts; combine sums the rows per original token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mori_integrations.vllm import quant
from mori_integrations.vllm.mori_utils import combine_dtype_for


@dataclass
class ReceivedTokens:
    """The valid rows of one dispatch on the receiving rank (``num_tokens`` rows each).

    Attributes:
        hidden_states: ``[R, H]`` token rows (quantised when scales are present).
        scales: ``[R, scale_dim]`` float32 scales, or None.
        topk_ids: ``[R, topk]`` int32 *global* expert ids (experts of other ranks included).
        topk_weights: ``[R, topk]`` float32 gating weights, aligned with ``topk_ids``.
        num_tokens: R, the number of tokens this rank received.
    """

    hidden_states: torch.Tensor
    scales: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int


@dataclass
class BatchedTokens:
    """What this rank received, in the batched (standard-MoE, DeepEP low-latency) layout.

    Attributes:
        hidden_states: ``[E_local, T, H]`` rows per local expert (``T = world * max_tokens``);
            rows ``[0, expert_num_tokens[e])`` of expert ``e`` are valid, by source rank then token.
        scales: ``[E_local, T, scale_dim]`` float32 scales of quantised rows, or None.
        expert_num_tokens: ``[E_local]`` int32 valid rows per local expert (on the device: the
            batched path never synchronises with the host).
    """

    hidden_states: torch.Tensor
    scales: Optional[torch.Tensor]
    expert_num_tokens: torch.Tensor


class MoriEpTokenExchange:
    """Dispatch/combine of one MoE layer on one rank.

    Args:
        op: a ``mori_core`` EP operator (GPU or reference) built for this layer's shape.
        rank: this rank in the EP group.
        num_local_experts: experts per rank; expert ``e`` lives on rank ``e // num_local_experts``.
        transport_fp8: quantise unquantised activations to FP8 for the dispatch and dequantise
            them on arrival (halves dispatch bytes for bf16 models).
        transport_groups: scales per token for FP8 transport; must equal the operator's
            ``scale_dim`` (1 = per token).
    """

    def __init__(
        self,
        op: Any,
        rank: int,
        num_local_experts: int,
        transport_fp8: bool = False,
        transport_groups: int = 1,
    ) -> None:
        self.op = op
        self.rank = int(rank)
        self.num_local_experts = int(num_local_experts)
        self.transport_fp8 = bool(transport_fp8)
        self.transport_groups = int(transport_groups)
        self.max_num_tokens = int(op.config.max_num_inp_token_per_rank)
        self.topk = int(op.config.num_experts_per_token)
        if self.transport_fp8 and self.transport_groups != int(op.config.scale_dim):
            raise ValueError(
                f"transport_groups={self.transport_groups} must equal the operator's scale_dim="
                f"{op.config.scale_dim} (scales travel in the operator's scale slots)"
            )
        # This rank's routing of the tokens in flight; combine must use exactly this.
        self._pre_dispatch_ids: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        scales: Optional[torch.Tensor] = None,
    ) -> ReceivedTokens:
        """Send this rank's tokens to the ranks owning their experts; return what arrived here.

        Args:
            hidden_states: ``[M, H]`` tokens (activations, or already quantised with ``scales``).
            topk_weights: ``[M, topk]`` gating weights.
            topk_ids: ``[M, topk]`` global expert ids.
            scales: ``[M, scale_dim]`` float32 scales of quantised ``hidden_states``, or None.

        The received-token count is read on the host (one device sync): vLLM's standard experts
        take exactly the valid rows, not the operator's capacity-sized buffers.
        """
        m = self._check_tokens(hidden_states, topk_ids, topk_weights)
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        tokens, scales, out_dtype = self._transport(hidden_states, scales, m)

        self._pre_dispatch_ids = ids
        recv, recv_weights, recv_scales, recv_ids, total_recv = self.op.dispatch(tokens, weights, scales, ids)
        r = int(total_recv[0].item())  # synchronises with the dispatch kernel
        check_error = getattr(self.op, "check_error", None)  # GPU operator: kernel-reported failures
        if check_error is not None:
            check_error(synchronize=False)
        recv = recv[:r]
        recv_scales = None if (scales is None or recv_scales is None) else recv_scales[:r]
        if out_dtype is not None:
            recv = quant.dequantize_rows(recv, recv_scales, out_dtype)
            recv_scales = None
        return ReceivedTokens(
            hidden_states=recv,
            scales=recv_scales,
            topk_ids=recv_ids[:r],
            topk_weights=recv_weights[:r],
            num_tokens=r,
        )

    # ------------------------------------------------------------------ batched layout
    def dispatch_batched(
        self,
        hidden_states: torch.Tensor,
        topk_weights: Optional[torch.Tensor],
        topk_ids: torch.Tensor,
        scales: Optional[torch.Tensor] = None,
    ) -> BatchedTokens:
        """Dispatch straight into the batched layout (``op.dispatch_standard_moe``).

        ``topk_weights`` travel with the tokens and are the weights :meth:`combine_batched`
        applies (None: weight 1, e.g. when they were applied to the input). FP8 transport
        quantises unquantised activations before dispatch and dequantises the received rows.
        """
        m = self._check_tokens(hidden_states, topk_ids, topk_weights)
        ids = topk_ids.to(torch.int32).contiguous()
        weights = None if topk_weights is None else topk_weights.to(torch.float32).contiguous()
        tokens, scales, out_dtype = self._transport(hidden_states, scales, m)
        self._pre_dispatch_ids = ids
        packed, count, _, _ = self.op.dispatch_standard_moe(tokens, weights, scales, ids)
        check_error = getattr(self.op, "check_error", None)
        if check_error is not None:
            check_error(synchronize=False)
        packed_scales = self.op.get_packed_recv_scales() if scales is not None else None
        if out_dtype is not None:  # rows past the counts hold garbage; experts never read them
            e, t, h = packed.shape
            packed = quant.dequantize_rows(packed.view(e * t, h), packed_scales.view(e * t, -1), out_dtype).view(e, t, h)
            packed_scales = None
        return BatchedTokens(hidden_states=packed, scales=packed_scales, expert_num_tokens=count)

    def combine_batched(self, expert_output: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Combine batched expert outputs ``[E_local, T, H]`` (``op.combine_standard_moe``): each
        token's rows weighted by the dispatched weights, summed per rank, then over ranks.

        Returns ``[M, H]`` (``out`` if given, else a copy in ``expert_output``'s dtype).
        """
        ids = self._pre_dispatch_ids
        if ids is None:
            raise RuntimeError("combine_batched() needs a preceding dispatch_batched() on this layer")
        m = int(ids.shape[0])
        rows = expert_output.to(combine_dtype_for(expert_output.dtype)).contiguous()
        combined = self.op.combine_standard_moe(rows, None, ids)[0][:m]
        self._pre_dispatch_ids = None
        return _deliver(combined, expert_output.dtype, out)

    def _transport(
        self, hidden_states: torch.Tensor, scales: Optional[torch.Tensor], m: int
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.dtype]]:
        """Rows and float32 ``[m, scale_dim]`` scales to dispatch, and the dtype to dequantise the
        received rows back to (FP8 transport of unquantised activations; else None)."""
        tokens = hidden_states.contiguous()
        out_dtype = None
        if scales is None and self.transport_fp8 and tokens.dtype.itemsize > 1:
            out_dtype = tokens.dtype
            tokens, scales = quant.quantize_rows(tokens, self.transport_groups)
        if scales is not None:
            scales = scales.to(torch.float32).reshape(m, int(self.op.config.scale_dim)).contiguous()
        return tokens, scales, out_dtype

    def _check_tokens(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: Optional[torch.Tensor]) -> int:
        """Shape checks shared by both layouts; returns the token count."""
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be 2-D [tokens, hidden], got shape {tuple(hidden_states.shape)}")
        m = int(hidden_states.shape[0])
        if m > self.max_num_tokens:
            raise ValueError(
                f"{m} tokens exceed max_num_tokens_per_rank={self.max_num_tokens} of the EP operator "
                "(raise --max-num-batched-tokens consistently on every rank)"
            )
        shapes = [tuple(topk_ids.shape)] + ([] if topk_weights is None else [tuple(topk_weights.shape)])
        if any(sh != (m, self.topk) for sh in shapes):
            raise ValueError(f"topk_ids/topk_weights must be [{m}, {self.topk}], got {' / '.join(map(str, shapes))}")
        return m

    # ------------------------------------------------------------------ experts side
    def local_expert_mask(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``[R, topk]`` bool: which entries name an expert hosted by this rank."""
        lo = self.rank * self.num_local_experts
        ids = topk_ids.to(torch.int64)
        return (ids >= lo) & (ids < lo + self.num_local_experts)

    def weight_and_reduce(
        self,
        expert_output: torch.Tensor,
        received: ReceivedTokens,
        apply_weights: bool = True,
    ) -> torch.Tensor:
        """Reduce per-(token, k) expert outputs to one row per received token.

        For experts that leave weight application and the top-k sum to finalize. Entries of
        other ranks' experts are excluded (those ranks return their own share); the sum is
        accumulated in float32.

        Args:
            expert_output: ``[R, topk, H]`` (or ``[R * topk, H]``) unweighted expert outputs.
            received: the dispatch result these outputs belong to.
            apply_weights: multiply by the gating weights (False when they were applied to the
                inputs before dispatch).

        Returns:
            ``[R, H]`` in the dtype of ``expert_output``.
        """
        r, k = received.num_tokens, self.topk
        h = int(expert_output.shape[-1])
        if expert_output.numel() != r * k * h:
            raise ValueError(f"expert_output must hold [{r}, {k}, {h}] values, got shape {tuple(expert_output.shape)}")
        out3 = expert_output.reshape(r, k, h)
        local = self.local_expert_mask(received.topk_ids)
        coeff = received.topk_weights.to(torch.float32) if apply_weights else torch.ones(r, k, device=out3.device)
        coeff = torch.where(local, coeff, torch.zeros_like(coeff)).unsqueeze(-1)
        # where() rather than a multiply: rows of non-local experts may hold garbage (NaN).
        terms = torch.where(local.unsqueeze(-1), out3.to(torch.float32) * coeff, torch.zeros((), device=out3.device))
        return terms.sum(dim=1).to(expert_output.dtype)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Return each received token's row to its source and sum per original token.

        Args:
            expert_rows: ``[R, H]`` one row per received token, in dispatch order.
            out: optional ``[M, H]`` destination (written in place and returned).

        Returns:
            ``[M, H]`` combined MoE output of this rank's tokens.
        """
        ids = self._pre_dispatch_ids
        if ids is None:
            raise RuntimeError("combine() needs a preceding dispatch() on this layer")
        m = int(ids.shape[0])
        combine_dtype = combine_dtype_for(expert_rows.dtype)
        rows = expert_rows.to(combine_dtype).contiguous()
        combined = self.op.combine(rows, None, ids)[0][:m]
        self._pre_dispatch_ids = None
        return _deliver(combined, expert_rows.dtype, out)


def _deliver(combined: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    """Copy the operator's combine output (a buffer the next layer reuses) into ``out`` or a new tensor."""
    if out is None:
        return combined.to(dtype, copy=True)
    if tuple(out.shape) != tuple(combined.shape):
        raise ValueError(f"out must have shape {list(combined.shape)}, got {tuple(out.shape)}")
    out.copy_(combined)
    return out
