"""Standard-MoE (3-D, DeepEP-layout) part of the IntraNode engine.

MORI's names, arguments and returns are the op's (:class:`~mori_core.ops.EpDispatchCombineOp`);
layout and numerics: :mod:`mori_core.ops.standard_moe_layout`. No build flag: the layout's buffers
(``E * T * hidden * max_token_type_size`` bytes for the rows, ``T = world_size *
max_num_inp_token_per_rank``) are taken from the symmetric heap on the first call of any of these
methods. That first call is collective (every rank, same order, like creating an op) and
synchronises; later calls launch kernels only (CUDA-graph capturable).

* ``dispatch`` = one plan kernel (ranks this rank's tokens per expert, publishes the per-expert
  counts to every rank) + the dispatch kernel in standard-MoE mode (each row crosses the link once
  per destination rank, as in a plain dispatch, with its position among this rank's rows of each
  of the destination's experts) + an expand kernel on the receiving side (a local copy of each
  row to its final ``[expert, row]`` positions).
* ``combine`` = the push combine kernel in standard-MoE mode: while pushing a received token back it
  sums the token's expert rows weighted by its gating weights (no separate conversion pass), then
  reduces over ranks as ``combine``.
* ``convert_dispatch_output`` / ``convert_combine_input``: the standalone converters between the 2-D
  dispatch output and the 3-D layout (exact inverses in layout: the second reads back exactly the
  rows the first placed).

The op has already checked for a failed op, the launch overrides and that a dispatch preceded;
``plan(kernel, tokens, block_num, warp_per_block)`` is the op's cached launch resolution.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from mori_core.ops.call_cache import stream_handle_getter, typed_view
from mori_core.ops.config import EpDispatchCombineConfig
from mori_core.ops.engines.gpu_common import byte_views
from mori_core.ops.errors import EpOpError
from mori_core.ops.launch_config import LaunchParams
from mori_core.ops.standard_moe_layout import StdOutputs, check_packed_input, check_unused_weights, tokens_per_expert
from mori_core.ops.validation import COMBINE_DTYPE_CODES, COMBINE_DTYPES, DISPATCH_DTYPES

Plan = Callable[[str, int, int, int], LaunchParams]


class IntraNodeStandardMoe:
    """The standard-MoE kernels of one IntraNode op (buffers allocated on first use)."""

    fused = True  # dispatch/combine straight into/out of the 3-D layout (no 2-D pass)

    def __init__(self, handle: Any, config: EpDispatchCombineConfig, device: torch.device, failure: type) -> None:
        self._handle = handle
        self.config = config
        self.device = device
        self._failure = failure
        self._stream_of = stream_handle_getter()
        self._bufs: Optional[dict] = None
        self._views: dict[tuple[torch.dtype, int], StdOutputs] = {}
        self._scale_dtype: Optional[torch.dtype] = None

    # ------------------------------------------------------------------ buffers
    def _ensure(self) -> dict:
        """Allocate the layout's buffers on first use (collective) and return their byte views."""
        if self._bufs is None:
            from mori_core import shmem

            offset = self._handle.ensure_standard_moe()
            shmem.verify_symmetric("ep_std_offset", offset)
            self._bufs = byte_views(self._handle.standard_moe_buffers(), self.device)
        return self._bufs

    def _outputs(self, dtype: torch.dtype, hidden: int) -> StdOutputs:
        """The 3-D outputs viewed as ``dtype`` rows of ``hidden`` (built once per key: views cost
        microseconds each, a call's whole host budget)."""
        out = self._views.get((dtype, hidden))
        if out is None:
            cfg, bufs = self.config, self._bufs
            E, T = cfg.num_experts_per_rank, tokens_per_expert(cfg)
            out = self._views[(dtype, hidden)] = (
                typed_view(bufs["packed_x"], dtype, E * T, hidden).view(E, T, hidden),
                bufs["packed_count"].view(torch.int32)[:E],
                bufs["packed_src_info"].view(torch.int32)[: E * T].view(E, T),
                bufs["layout_range"].view(torch.int64)[: E * cfg.world_size].view(E, cfg.world_size),
            )
        return out

    def _stream(self) -> int:
        return self._stream_of(self.device.index)

    def _launch(self, launch: Callable[..., None], *args: int) -> None:
        """Run one of the handle's launch methods; a failed op raises EpOpError like dispatch/combine."""
        try:
            launch(*args)
        except self._failure as e:
            raise EpOpError(str(e)) from None

    # ------------------------------------------------------------------ dispatch side
    def dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                 indices: torch.Tensor, num_tokens: int, row_bytes: int, plan: LaunchParams) -> StdOutputs:
        """``dispatch_standard_moe`` of arguments the op has validated (``scales`` None when none
        travel); returns the op's 3-D outputs (views built once per dtype and hidden size)."""
        bufs = self._ensure()
        self._launch(
            self._handle.launch_dispatch_standard_moe,
            input.data_ptr(),
            row_bytes,
            num_tokens,
            # Non-zero whenever weights were given, also for 0 tokens, whose empty tensor has address 0:
            # receivers weight the rows they get only if the sender's call carried weights. The
            # kernel reads no weights for 0 tokens, so any valid buffer of the op stands in.
            0 if weights is None else (weights.data_ptr() or bufs["packed_count"].data_ptr()),
            0 if scales is None else scales.data_ptr(),
            indices.data_ptr(),
            plan.block_num,
            plan.warp_per_block,
            self._stream(),
        )
        if scales is not None:
            self._scale_dtype = scales.dtype
        return self._outputs(input.dtype, row_bytes // input.element_size())

    def convert_dispatch_output(self, x: torch.Tensor, ids: torch.Tensor, dispatch_tokens: int, block_num: int,
                                warp_per_block: int, plan: Plan) -> StdOutputs:
        """``convert_dispatch_output`` of the 2-D rows ``x`` and their top-k ids ``ids``."""
        cfg = self.config
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"dispatch_out_x must be a 2-D tensor [rows, hidden], got {getattr(x, 'shape', x)!r}")
        h = int(x.shape[1])
        if not 1 <= h <= cfg.hidden_dim or x.dtype not in DISPATCH_DTYPES or x.element_size() > cfg.max_token_type_size:
            raise ValueError(
                f"dispatch_out_x must hold rows of 1..hidden_dim={cfg.hidden_dim} elements of a dispatch dtype of at "
                f"most max_token_type_size={cfg.max_token_type_size} bytes, got {x.dtype} {tuple(x.shape)}"
            )
        if (h * x.element_size()) % 16:
            raise ValueError(f"dispatch_out_x rows must be a multiple of 16 bytes, got {h} x {x.element_size()} B")
        if x.device != self.device or not x.is_contiguous():
            raise ValueError(f"dispatch_out_x must be contiguous on {self.device}")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or tuple(ids.shape) != (x.shape[0], cfg.num_experts_per_token):
            raise ValueError(
                f"dispatch_out_topk_idx must be int32 [{x.shape[0]}, {cfg.num_experts_per_token}] (aligned with "
                f"dispatch_out_x), got {getattr(ids, 'dtype', None)} {tuple(getattr(ids, 'shape', ()))}"
            )
        if ids.device != self.device or not ids.is_contiguous():
            raise ValueError(f"dispatch_out_topk_idx must be contiguous on {self.device}")
        self._ensure()
        rows = dispatch_tokens * cfg.num_experts_per_token  # copies per token, as dispatch_standard_moe
        p = plan("dispatch", rows, block_num, warp_per_block)
        self._launch(
            self._handle.launch_convert_dispatch_output,
            x.data_ptr(), h * x.element_size(), int(x.shape[0]), ids.data_ptr(), p.block_num, p.warp_per_block, self._stream()
        )
        return self._outputs(x.dtype, h)

    def packed_recv_scales(self, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
        """``get_packed_recv_scales``: dtype defaults to the scales given to the fused dispatch
        (float32 after a plain dispatch + conversion)."""
        cfg = self.config
        if cfg.scale_dim == 0:
            return None
        dtype = dtype or self._scale_dtype or torch.float32
        if torch.empty(0, dtype=dtype).element_size() != cfg.scale_type_size:
            raise ValueError(f"dtype {dtype} does not have scale_type_size={cfg.scale_type_size} bytes")
        E, T = cfg.num_experts_per_rank, tokens_per_expert(cfg)
        bufs = self._ensure()
        return typed_view(bufs["packed_scales"], dtype, E * T, cfg.scale_dim).view(E, T, cfg.scale_dim)

    # ------------------------------------------------------------------ combine side
    def convert_combine_input(
        self, packed: torch.Tensor, dispatch_tokens: int, block_num: int, warp_per_block: int, plan: Plan
    ) -> tuple[torch.dtype, int]:
        """``convert_combine_input`` into the registered buffer; returns the (dtype, hidden) to view it with."""
        h = check_packed_input(self.config, "packed_recv_x", packed, COMBINE_DTYPES, self.device)
        self._ensure()
        p = plan("combine_push", dispatch_tokens, block_num, warp_per_block)
        self._launch(
            self._handle.launch_convert_combine_input,
            packed.data_ptr(), COMBINE_DTYPE_CODES[packed.dtype], h, p.block_num, p.warp_per_block, self._stream(),
        )
        return packed.dtype, h

    def combine(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor,
                dispatch_tokens: int, block_num: int, warp_per_block: int, plan: Plan
                ) -> tuple[torch.dtype, int, LaunchParams]:
        """``combine_standard_moe``; returns the (dtype, hidden) of the combined rows and the launch used."""
        cfg = self.config
        h = check_packed_input(cfg, "input", input, COMBINE_DTYPES, self.device)
        n = dispatch_tokens
        if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or tuple(indices.shape) != (n, cfg.num_experts_per_token):
            raise ValueError(
                f"indices must be this rank's own routing passed to dispatch, int32 [{n}, {cfg.num_experts_per_token}]; "
                f"got {getattr(indices, 'dtype', None)} {tuple(getattr(indices, 'shape', ()))}"
            )
        if indices.device != self.device or not indices.is_contiguous():
            raise ValueError(f"indices must be contiguous on {self.device}")
        check_unused_weights(weights, n, cfg.num_experts_per_token)
        self._ensure()
        p = plan("combine_push", n, block_num, warp_per_block)
        self._launch(
            self._handle.launch_combine_standard_moe,
            input.data_ptr(), COMBINE_DTYPE_CODES[input.dtype], h, indices.data_ptr(), n, p.block_num, p.warp_per_block,
            self._stream(),
        )
        return input.dtype, h, p
