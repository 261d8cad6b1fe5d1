"""The standard-MoE (DeepEP low-latency, "3-D") layout of MORI-EP: shapes, argument checks and
the CPU construction of the layout shared by the GPU and reference ops.

After ``dispatch_standard_moe`` (or ``dispatch`` + ``convert_dispatch_output``) each rank holds,
for each of its ``E = num_experts_per_rank`` local experts, the rows routed to that expert:

* ``packed_recv_x[E, T, hidden]`` with ``T = world_size * max_num_inp_token_per_rank``: rows
  ``[0, packed_recv_count[e])`` of expert ``e`` are valid, ordered by **source rank, then source
  token** (stable; MORI's own order is arrival order). A token that lists the same expert twice
  gets one row.
* ``packed_recv_count[E]`` int32: valid rows per local expert.
* ``packed_recv_src_info[E, T]`` int32: each row's flat source index
  ``src_rank * max_num_tokens_to_send() + src_token`` (as ``get_dispatch_src_token_pos``).
* ``packed_recv_layout_range[E, world]`` int64: rows from each source rank, DeepEP's packing
  ``count | begin << 32`` (MORI returns an empty tensor here; the stable order makes the ranges
  exact).

``convert_combine_input`` / ``combine_standard_moe`` sum, for every received token, its local
experts' rows weighted by the token's gating weights (the ``weights`` given to dispatch; 1 when
dispatch had none): ``sum_k w_k * packed[row_k]`` in float32, k in order, each product rounded on
its own, rounded once to the row dtype. The combine then sums those rows over ranks as usual.
"""

from __future__ import annotations

from typing import Optional

import torch

from mori_core.ops.config import EpDispatchCombineConfig
from mori_core.ops.validation import check_rows

# (packed_recv_x [E, T, hidden], packed_recv_count [E] int32, packed_recv_src_info [E, T] int32,
#  packed_recv_layout_range [E, world] int64): what dispatch_standard_moe returns.
StdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def tokens_per_expert(config: EpDispatchCombineConfig) -> int:
    """Rows reserved per local expert: ``world_size * max_num_inp_token_per_rank`` (MORI's size)."""
    return config.world_size * config.max_num_inp_token_per_rank


def check_packed_input(
    config: EpDispatchCombineConfig,
    name: str,
    packed: torch.Tensor,
    allowed_dtypes: tuple,
    device: Optional[torch.device] = None,
) -> int:
    """Validate a ``[num_experts_per_rank, T, hidden]`` layout tensor; returns ``hidden``."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    shape = (config.num_experts_per_rank, tokens_per_expert(config))
    if packed.dim() != 3 or tuple(packed.shape[:2]) != shape:
        raise ValueError(
            f"{name} must have shape [num_experts_per_rank={shape[0]}, world_size * max_num_inp_token_per_rank="
            f"{shape[1]}, hidden], got {tuple(packed.shape)}"
        )
    h = int(packed.shape[2])
    check_rows(packed, h, config, allowed_dtypes, device, name=name)
    return h


def check_unused_weights(weights: Optional[torch.Tensor], num_tokens: int, topk: int) -> None:
    """combine_standard_moe's ``weights`` (kept for MORI's signature): None or ``[num_tokens, topk]`` float32."""
    if weights is None or (isinstance(weights, torch.Tensor) and weights.numel() == 0):
        return
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 or weights.dim() != 2 or weights.shape[1] != topk:
        raise ValueError(
            f"weights must be None or float32 [num_tokens={num_tokens}, topk={topk}] (the gating weights applied "
            "are those passed to dispatch)"
        )


class PackedLayout:
    """The 3-D layout of one dispatch built on the host (reference op; GPU test oracle).

    Args:
        config: the op config (this rank's ``rank``).
        src_pos: ``[R]`` flat source index of each received row.
        indices: ``[R, topk]`` global expert ids of each received row.
    """

    def __init__(self, config: EpDispatchCombineConfig, src_pos: torch.Tensor, indices: torch.Tensor) -> None:
        E, T, world, topk = config.num_experts_per_rank, tokens_per_expert(config), config.world_size, config.num_experts_per_token
        lo = config.rank * E
        R = int(src_pos.shape[0])
        ids = indices[:R].to(torch.int64).cpu()
        src = src_pos.to(torch.int64).cpu()
        order = torch.argsort(src, stable=True)  # source rank, then source token
        self.rows = torch.full((R, topk), -1, dtype=torch.int32)  # packed row of (received row, k)
        self.count = torch.zeros(E, dtype=torch.int32)
        self.src_info = torch.full((E, T), -1, dtype=torch.int32)
        self.layout_range = torch.zeros(E, world, dtype=torch.int64)
        self.gather = [[] for _ in range(E)]  # received row of each packed row, per expert
        stride = config.max_num_tokens_to_send()
        per_source = torch.zeros(E, world, dtype=torch.int64)
        for i in order.tolist():
            seen: dict[int, int] = {}
            for k in range(topk):
                e = int(ids[i, k])
                if not lo <= e < lo + E:
                    continue
                if e not in seen:
                    el = e - lo
                    pos = int(self.count[el])
                    self.count[el] += 1
                    seen[e] = el * T + pos
                    self.src_info[el, pos] = int(src[i])
                    self.gather[el].append(i)
                    per_source[el, int(src[i]) // stride] += 1
                self.rows[i, k] = seen[e]
        begin = torch.cumsum(per_source, dim=1) - per_source
        self.layout_range = per_source | (begin << 32)

    def pack(self, rows: torch.Tensor, hidden_shape: tuple) -> torch.Tensor:
        """``[E, T, *hidden_shape]`` tensor of ``rows`` (received-row order) placed in the layout; zeros elsewhere."""
        E, T = self.src_info.shape
        out = torch.zeros((E, T) + tuple(hidden_shape), dtype=rows.dtype, device=rows.device)
        for el, members in enumerate(self.gather):
            if members:
                out[el, : len(members)] = rows[torch.tensor(members, dtype=torch.int64, device=rows.device)]
        return out

    def reduce(self, packed: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        """float32 ``[R, hidden]``: ``sum_k w_k * packed[row_k]`` per received row (k in order)."""
        R, topk = self.rows.shape
        flat = packed.reshape(-1, packed.shape[-1])
        acc = torch.zeros(R, flat.shape[1], dtype=torch.float32, device=packed.device)
        rows = self.rows.to(packed.device)
        for k in range(topk):
            sel = torch.nonzero(rows[:, k] >= 0).flatten()
            if sel.numel() == 0:
                continue
            vals = flat[rows[sel, k].to(torch.int64)].to(torch.float32)
            if weights is not None:
                vals = vals * weights[sel, k : k + 1].to(torch.float32)
            acc[sel] = acc[sel] + vals
        return acc
