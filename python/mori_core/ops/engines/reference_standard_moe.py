"""Standard-MoE (3-D, DeepEP-layout) part of the reference engine.

Same names, arguments, returns and numerics as the IntraNode kernels'
(:mod:`mori_core.ops.engines.intranode_standard_moe`); the layout is documented in
:mod:`mori_core.ops.standard_moe_layout`. Built on the host from the engine's dispatch state. It
has no fused kernels: the op runs ``dispatch`` + :meth:`ReferenceStandardMoe.convert_dispatch_output`
for ``dispatch_standard_moe`` and :meth:`ReferenceStandardMoe.convert_combine_input` + a push
``combine`` for ``combine_standard_moe``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from mori_core.ops.call_cache import typed_view
from mori_core.ops.launch_config import LaunchParams
from mori_core.ops.standard_moe_layout import PackedLayout, StdOutputs, check_packed_input
from mori_core.ops.validation import DISPATCH_DTYPES

Plan = Callable[[str, int, int, int], LaunchParams]


class ReferenceStandardMoe:
    """The layout of the reference engine's current dispatch (``engine._state``)."""

    fused = False

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.config = engine.config
        self.device = engine.device
        self._layout: Optional[PackedLayout] = None
        self._round = 0
        self._scales: Optional[torch.Tensor] = None

    def convert_dispatch_output(self, x: torch.Tensor, ids: torch.Tensor, dispatch_tokens: int, block_num: int,
                                warp_per_block: int, plan: Plan) -> StdOutputs:
        """Lay the 2-D dispatch output (rows in dispatch-output order, at least ``total_recv``)
        out as the 3-D standard-MoE layout."""
        st = self._engine._state
        total = st["total_recv"]
        cfg = self.config
        if x.dim() != 2 or x.shape[0] < total:
            raise ValueError(f"dispatch_out_x must be 2-D with at least total_recv={total} rows, got {tuple(x.shape)}")
        if x.dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dispatch_out_x dtype {x.dtype} is not supported")
        idx_shape = tuple(ids.shape)
        good_idx = ids.dtype == torch.int32 and len(idx_shape) == 2
        if not (good_idx and idx_shape[1] == cfg.num_experts_per_token and idx_shape[0] >= total):
            raise ValueError(
                f"dispatch_out_topk_idx must be int32 [>= {total}, {cfg.num_experts_per_token}], got "
                f"{ids.dtype} {tuple(ids.shape)}"
            )
        layout = PackedLayout(cfg, st["src_pos"], ids[:total])
        self._layout, self._round = layout, st["round"]
        h = int(x.shape[1])
        packed = layout.pack(x[:total].to(self.device), (h,))
        recv_scales = st.get("recv_scales")
        self._scales = None if recv_scales is None else layout.pack(recv_scales, (recv_scales.shape[1],))
        return (
            packed,
            layout.count.to(self.device),
            layout.src_info.to(self.device),
            layout.layout_range.to(self.device),
        )

    def packed_recv_scales(self, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
        """Scales of the 3-D layout ``[E, T, scale_dim]`` (None when the dispatch carried none);
        ``dtype`` defaults to float32."""
        dtype = dtype or torch.float32
        if self._scales is None:
            return None
        return self._scales.view(dtype) if self._scales.dtype != dtype else self._scales

    def _current_layout(self) -> PackedLayout:
        st = self._engine._state
        if st is None or self._layout is None or self._round != st["round"]:
            raise RuntimeError(
                "no standard-MoE layout of the current dispatch: call dispatch_standard_moe() or "
                "convert_dispatch_output() after dispatch() first"
            )
        return self._layout

    def convert_combine_input(
        self, packed: torch.Tensor, dispatch_tokens: int, block_num: int, warp_per_block: int, plan: Plan
    ) -> tuple[torch.dtype, int]:
        """Sum each received token's local-expert rows of ``packed`` ``[E, T, hidden]`` weighted by
        its gating weights into the registered combine input; returns its (dtype, hidden)."""
        h = check_packed_input(self.config, "packed_recv_x", packed, (torch.bfloat16, torch.float32))
        layout = self._current_layout()
        st = self._engine._state
        acc = layout.reduce(packed.to(self.device), st["recv_weights"])
        reg = typed_view(self._engine._registered, packed.dtype, self.config.max_num_tokens_to_recv(), h)
        reg[: st["total_recv"]] = acc.to(packed.dtype)
        return packed.dtype, h
