"""Single-process MoE reference and deterministic test problems (no vLLM import).

Every rank rebuilds the same global problem from the seed, takes its own tokens and experts
for the distributed run, and compares against :func:`reference_moe` over all tokens with all
experts. Shared by the CPU numerics test (vLLM's modular kernel) and the GPU check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass
class MoeProblem:
    """A global MoE problem: tokens of every rank, routing and every expert's weights.

    Attributes:
        tokens_per_rank: tokens of each rank (ragged, may be 0).
        x: ``[T, H]`` all tokens, rank 0's first.
        topk_ids: ``[T, k]`` int32 distinct global expert ids per token.
        topk_weights: ``[T, k]`` float32 gating weights.
        w13: ``[E, 2I, H]`` gate and up projections (vLLM's layout: gate rows first).
        w2: ``[E, H, I]`` down projections.
    """

    tokens_per_rank: Sequence[int]
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor

    def rank_slice(self, rank: int) -> slice:
        """Rows of ``x`` that belong to ``rank``."""
        start = sum(self.tokens_per_rank[:rank])
        return slice(start, start + self.tokens_per_rank[rank])

    def local_experts(self, rank: int, world_size: int) -> slice:
        """Experts hosted by ``rank`` (linear placement)."""
        per = self.w13.shape[0] // world_size
        return slice(rank * per, (rank + 1) * per)


def make_problem(
    seed: int,
    tokens_per_rank: Sequence[int],
    hidden: int,
    intermediate: int,
    num_experts: int,
    topk: int,
    dtype: torch.dtype,
    device: Optional[torch.device] = None,
) -> MoeProblem:
    """Random tokens, random top-k routing (distinct experts per token) and random experts."""
    g = torch.Generator().manual_seed(seed)
    total = sum(tokens_per_rank)
    x = torch.randn(total, hidden, generator=g)
    scores = torch.rand(total, num_experts, generator=g)
    topk_ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    # Not normalised: with top-1 a softmax weight would be exactly 1 and hide weighting bugs.
    topk_weights = (0.25 + torch.rand(total, topk, generator=g)).to(torch.float32)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate**0.5
    return MoeProblem(
        tokens_per_rank=list(tokens_per_rank),
        x=x.to(dtype=dtype, device=device or "cpu"),
        topk_ids=topk_ids.to(device or "cpu"),
        topk_weights=topk_weights.to(device or "cpu"),
        w13=w13.to(dtype=dtype, device=device or "cpu"),
        w2=w2.to(dtype=dtype, device=device or "cpu"),
    )


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's gated SiLU FFN in float32: ``(silu(x Wg^T) * (x Wu^T)) W2^T``."""
    inter = w2.shape[1]
    h = x.to(torch.float32) @ w13.to(torch.float32).t()
    return (F.silu(h[:, :inter]) * h[:, inter:]) @ w2.to(torch.float32).t()


def reference_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_input: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """Single-process MoE: ``out[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t])`` in float32.

    Args:
        expert_input: optional ``f(x_rows, expert)`` giving what the expert actually sees
            (e.g. x after FP8 quantise/dequantise); default: x itself.
        weight_on_input: scale the input by the weight instead of the output (top-1).
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        w = topk_weights[rows, slots].to(torch.float32).unsqueeze(1)
        xe = x[rows]
        if weight_on_input:
            xe = (xe.to(torch.float32) * w).to(x.dtype)
        if expert_input is not None:
            xe = expert_input(xe, e)
        y = expert_ffn(xe, w13[e], w2[e])
        out.index_add_(0, rows, y if weight_on_input else y * w)
    return out
