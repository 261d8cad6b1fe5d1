"""Standard-MoE (3-D, DeepEP-layout) methods of :class:`~mori_core.ops.ReferenceEpDispatchCombineOp`.

Same names, arguments, returns and numerics as the GPU op's
(:mod:`mori_core.ops.standard_moe`); the layout is documented in
:mod:`mori_core.ops.standard_moe_layout`. Built from the op's dispatch state on the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from mori_core.ops.standard_moe_layout import (
    PackedLayout,
    check_packed_input,
    check_unused_weights,
    tokens_per_expert,
)
from mori_core.ops.validation import DISPATCH_DTYPES, check_launch_overrides

_StdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class ReferenceStandardMoeMixin:
    """dispatch_standard_moe / combine_standard_moe / convert_dispatch_output / convert_combine_input.

    Relies on the reference op's ``config``, ``device``, ``_state`` (set by dispatch),
    ``dispatch``, ``combine`` and ``get_registered_combine_input_buffer``.
    """

    _std_layout: Optional[PackedLayout] = None
    _std_round: int = 0
    _std_scales: Optional[torch.Tensor] = None

    def dispatch_standard_moe(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        scales: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
    ) -> _StdOutputs:
        """Dispatch straight into the 3-D layout.

        Returns ``(packed_recv_x [E, T, hidden], packed_recv_count [E] int32,
        packed_recv_src_info [E, T] int32, packed_recv_layout_range [E, world] int64)``.
        Scales (``scale_dim > 0``) are laid out the same way: :meth:`get_packed_recv_scales`.
        """
        out, _, _, out_idx, total = self.dispatch(
            input, weights, scales, indices, block_num=block_num, rdma_block_num=rdma_block_num,
            warp_per_block=warp_per_block,
        )
        n = int(total[0])
        return self.convert_dispatch_output(out[:n], out_idx[:n])

    def convert_dispatch_output(
        self,
        dispatch_out_x: torch.Tensor,
        dispatch_out_topk_idx: torch.Tensor,
        block_num: int = -1,
        warp_per_block: int = -1,
    ) -> _StdOutputs:
        """Lay the 2-D dispatch output (rows in dispatch-output order, at least ``total_recv``)
        out as the 3-D standard-MoE layout; same returns as :meth:`dispatch_standard_moe`."""
        check_launch_overrides(block_num, -1, warp_per_block)
        st = self._state
        if st is None:
            raise RuntimeError("convert_dispatch_output() needs a preceding dispatch()")
        total = st["total_recv"]
        cfg = self.config
        if dispatch_out_x.dim() != 2 or dispatch_out_x.shape[0] < total:
            raise ValueError(
                f"dispatch_out_x must be 2-D with at least total_recv={total} rows, got {tuple(dispatch_out_x.shape)}"
            )
        if dispatch_out_x.dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dispatch_out_x dtype {dispatch_out_x.dtype} is not supported")
        idx_shape = tuple(dispatch_out_topk_idx.shape)
        good_idx = dispatch_out_topk_idx.dtype == torch.int32 and len(idx_shape) == 2
        if not (good_idx and idx_shape[1] == cfg.num_experts_per_token and idx_shape[0] >= total):
            raise ValueError(
                f"dispatch_out_topk_idx must be int32 [>= {total}, {cfg.num_experts_per_token}], got "
                f"{dispatch_out_topk_idx.dtype} {tuple(dispatch_out_topk_idx.shape)}"
            )
        layout = PackedLayout(cfg, st["src_pos"], dispatch_out_topk_idx[:total])
        self._std_layout, self._std_round = layout, st["round"]
        h = int(dispatch_out_x.shape[1])
        packed = layout.pack(dispatch_out_x[:total].to(self.device), (h,))
        recv_scales = st.get("recv_scales")
        self._std_scales = None if recv_scales is None else layout.pack(recv_scales, (recv_scales.shape[1],))
        return (
            packed,
            layout.count.to(self.device),
            layout.src_info.to(self.device),
            layout.layout_range.to(self.device),
        )

    def get_packed_recv_scales(self, dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
        """Scales of the 3-D layout ``[E, T, scale_dim]`` (None when the dispatch carried none)."""
        if self._std_scales is None:
            return None
        return self._std_scales.view(dtype) if self._std_scales.dtype != dtype else self._std_scales

    def _current_layout(self) -> PackedLayout:
        st = self._state
        if st is None or self._std_layout is None or self._std_round != st["round"]:
            raise RuntimeError(
                "no standard-MoE layout of the current dispatch: call dispatch_standard_moe() or "
                "convert_dispatch_output() after dispatch() first"
            )
        return self._std_layout

    def convert_combine_input(
        self,
        packed_recv_x: torch.Tensor,
        packed_recv_src_info: Optional[torch.Tensor] = None,
        packed_recv_layout_range: Optional[torch.Tensor] = None,
        block_num: int = -1,
        warp_per_block: int = -1,
    ) -> torch.Tensor:
        """Sum each received token's local-expert rows of ``packed_recv_x`` ``[E, T, hidden]``
        weighted by its gating weights into the registered combine input.

        Returns the view ``[max_num_tokens_to_recv(), hidden]`` of the registered buffer (rows in
        dispatch-output order), ready for ``combine(...)`` in either mode.
        ``packed_recv_src_info`` / ``packed_recv_layout_range`` are accepted for MORI's signature and
        not read (the layout of the current dispatch is known to the op).
        """
        check_launch_overrides(block_num, -1, warp_per_block)
        h = check_packed_input(self.config, "packed_recv_x", packed_recv_x, (torch.bfloat16, torch.float32))
        layout = self._current_layout()
        st = self._state
        acc = layout.reduce(packed_recv_x.to(self.device), st["recv_weights"])
        reg = self.get_registered_combine_input_buffer(packed_recv_x.dtype, h)
        reg[: st["total_recv"]] = acc.to(packed_recv_x.dtype)
        return reg

    def combine_standard_moe(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        call_reset: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """Combine expert outputs given in the 3-D layout ``[E, T, hidden]``: each token's rows are
        weighted by its gating weights and summed per rank, then over ranks.

        ``weights`` is accepted for MORI's signature (None or ``[num_tokens, topk]`` float32); the
        gating weights applied are the ones given to dispatch. Returns
        ``(out [max_num_inp_token_per_rank, hidden], None)``.
        """
        check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        st = self._state
        if st is None:
            raise RuntimeError("combine_standard_moe() needs a preceding dispatch_standard_moe()")
        check_unused_weights(weights, st["num_tokens"], self.config.num_experts_per_token)
        rows = self.convert_combine_input(input)
        out, _ = self.combine(rows, None, indices, use_external_inp_buf=1)
        if call_reset:
            self.reset()
        return out, None

    def standard_moe_tokens_per_expert(self) -> int:
        """Rows per local expert of the 3-D layout (``world_size * max_num_inp_token_per_rank``)."""
        return tokens_per_expert(self.config)
