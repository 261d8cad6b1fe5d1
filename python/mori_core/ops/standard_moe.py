"""Standard-MoE (3-D, DeepEP-layout) methods of the GPU :class:`~mori_core.ops.EpDispatchCombineOp`.

MORI's names, arguments and returns (layout and numerics: :mod:`mori_core.ops.standard_moe_layout`).
No build flag: the layout's buffers (``E * T * hidden * max_token_type_size`` bytes for the rows,
``T = world_size * max_num_inp_token_per_rank``) are taken from the symmetric heap on the first
call of any of these methods. That first call is collective (every rank, same order, like creating
an op) and synchronises; later calls launch kernels only (CUDA-graph capturable).

* ``dispatch_standard_moe`` = one plan kernel (ranks this rank's tokens per expert, publishes the
  per-expert counts to every rank) + the dispatch kernel in standard-MoE mode, which stores each
  row straight to its final ``[expert, row]`` position on the destination (no 2-D pass).
* ``combine_standard_moe`` = the push combine kernel in standard-MoE mode: while pushing a
  received token back it sums the token's expert rows weighted by its gating weights (no
  separate conversion pass), then reduces over ranks as ``combine``.
* ``convert_dispatch_output`` / ``convert_combine_input``: the standalone converters between the
  2-D dispatch output and the 3-D layout (exact inverses in layout: the second reads back exactly
  the rows the first placed).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from mori_core.ops.call_cache import typed_view
from mori_core.ops.standard_moe_layout import check_packed_input, check_unused_weights, tokens_per_expert
from mori_core.ops.validation import COMBINE_DTYPES, DISPATCH_DTYPES, check_dispatch_args, check_launch_overrides

_COMBINE_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 1}
_StdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class StandardMoeMixin:
    """The four standard-MoE methods of the GPU op.

    Uses the op's ``config``, ``device``, ``_handle``, ``_launches``, ``_stream_of``, ``_failure``,
    ``_bufs``, ``check_error``, ``_dispatch_tokens`` and ``get_registered_combine_input_buffer``.
    """

    _std_bufs: Optional[dict] = None
    _std_scale_dtype: Optional[torch.dtype] = None

    # ------------------------------------------------------------------ buffers
    def _require_standard_moe_kernels(self) -> None:
        """The layout is built by the IntraNode kernels; the inter-node op (a subclass) has none."""
        if not hasattr(self._handle, "ensure_standard_moe"):
            raise NotImplementedError(
                f"the standard-MoE layout (dispatch_standard_moe / combine_standard_moe / converters) is implemented "
                f"for the IntraNode kernels, not for kernel_type {self.config.kernel_type}"
            )

    def _ensure_standard_moe(self) -> dict:
        """Allocate the layout's buffers on first use (collective) and return their byte views."""
        if self._std_bufs is None:
            self._require_standard_moe_kernels()
            from mori_core import shmem
            from mori_core.ops.dispatch_combine import _byte_view

            offset = self._handle.ensure_standard_moe()
            shmem.verify_symmetric("ep_std_offset", offset)
            self._std_bufs = {
                name: _byte_view(ptr, size, self.device) for name, (ptr, size) in self._handle.standard_moe_buffers().items()
            }
        return self._std_bufs

    def _std_outputs(self, dtype: torch.dtype, hidden: int) -> _StdOutputs:
        cfg, bufs = self.config, self._std_bufs
        E, T = cfg.num_experts_per_rank, tokens_per_expert(cfg)
        return (
            typed_view(bufs["packed_x"], dtype, E * T, hidden).view(E, T, hidden),
            bufs["packed_count"].view(torch.int32)[:E],
            bufs["packed_src_info"].view(torch.int32)[: E * T].view(E, T),
            bufs["layout_range"].view(torch.int64)[: E * cfg.world_size].view(E, cfg.world_size),
        )

    def _stream(self) -> int:
        return self._stream_of(self.device.index)

    def _launch_std(self, launch: Callable[..., None], *args: int) -> None:
        """Run one of the handle's launch methods; a failed op raises EpOpError like dispatch/combine."""
        from mori_core.ops.dispatch_combine import EpOpError

        try:
            launch(*args)
        except self._failure as e:
            raise EpOpError(str(e)) from None

    # ------------------------------------------------------------------ dispatch side
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
        """Dispatch straight into the 3-D standard-MoE layout (arguments as :meth:`dispatch`).

        Returns ``(packed_recv_x [E, T, hidden], packed_recv_count [E] int32,
        packed_recv_src_info [E, T] int32, packed_recv_layout_range [E, world] int64)``: views of
        the op's buffers, overwritten by the next standard-MoE dispatch/conversion. Scales
        (``scale_dim > 0``): :meth:`get_packed_recv_scales`. The plain 2-D dispatch outputs are not
        written; ``get_dispatch_src_token_pos`` and ``combine`` (with rows from
        :meth:`convert_combine_input`) still work.
        """
        self._require_standard_moe_kernels()
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        cfg = self.config
        args = check_dispatch_args(cfg, input, weights, scales, indices, device=self.device, allowed_dtypes=DISPATCH_DTYPES)
        row_bytes = args.hidden_dim * input.element_size()
        if row_bytes % 16:
            raise ValueError(f"input rows must be a multiple of 16 bytes, got hidden {args.hidden_dim} x {input.element_size()} B")
        self._ensure_standard_moe()
        # Sized as a dispatch of tokens x topk rows: every token is stored once per local expert.
        p = self._launches.get("dispatch", args.num_tokens * cfg.num_experts_per_token, block_num, warp_per_block)
        self._launch_std(
            self._handle.launch_dispatch_standard_moe,
            input.data_ptr(),
            row_bytes,
            args.num_tokens,
            # Non-zero whenever weights were given, also for 0 tokens (see EpDispatchCombineOp.dispatch).
            (weights.data_ptr() or self._out_weights_ptr) if args.has_weights else 0,
            scales.data_ptr() if args.has_scales else 0,
            indices.data_ptr(),
            p.block_num,
            p.warp_per_block,
            self._stream(),
        )
        self._dispatch_tokens = args.num_tokens
        self._std_scale_dtype = scales.dtype if args.has_scales else None
        return self._std_outputs(input.dtype, args.hidden_dim)

    def convert_dispatch_output(
        self,
        dispatch_out_x: torch.Tensor,
        dispatch_out_topk_idx: torch.Tensor,
        block_num: int = -1,
        warp_per_block: int = -1,
    ) -> _StdOutputs:
        """Lay this rank's 2-D dispatch output out as the 3-D layout (same returns as
        :meth:`dispatch_standard_moe`).

        Args:
            dispatch_out_x: ``[rows >= total_recv, hidden]`` received rows in dispatch-output order
                (normally ``dispatch(...)[0]``).
            dispatch_out_topk_idx: ``[rows, topk]`` int32 ids of those rows (``dispatch(...)[3]``).
        Scales of the dispatch are laid out too (:meth:`get_packed_recv_scales`).
        """
        self._require_standard_moe_kernels()
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, -1, warp_per_block)
        if self._dispatch_tokens is None:
            raise RuntimeError("convert_dispatch_output() needs a preceding dispatch()")
        cfg = self.config
        x, ids = dispatch_out_x, dispatch_out_topk_idx
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
        self._ensure_standard_moe()
        rows = self._dispatch_tokens * cfg.num_experts_per_token  # copies per token, as dispatch_standard_moe
        p = self._launches.get("dispatch", rows, block_num, warp_per_block)
        self._launch_std(
            self._handle.launch_convert_dispatch_output,
            x.data_ptr(), h * x.element_size(), int(x.shape[0]), ids.data_ptr(), p.block_num, p.warp_per_block, self._stream()
        )
        return self._std_outputs(x.dtype, h)

    def get_packed_recv_scales(self, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """View ``[E, T, scale_dim]`` of the scales in the 3-D layout, or None when ``scale_dim == 0``.

        ``dtype`` defaults to the dtype of the scales given to :meth:`dispatch_standard_moe`
        (float32 after a plain ``dispatch`` + :meth:`convert_dispatch_output`); its element size
        must be ``config.scale_type_size``.
        """
        cfg = self.config
        if cfg.scale_dim == 0:
            return None
        dtype = dtype or self._std_scale_dtype or torch.float32
        if torch.empty(0, dtype=dtype).element_size() != cfg.scale_type_size:
            raise ValueError(f"dtype {dtype} does not have scale_type_size={cfg.scale_type_size} bytes")
        E, T = cfg.num_experts_per_rank, tokens_per_expert(cfg)
        bufs = self._ensure_standard_moe()
        return typed_view(bufs["packed_scales"], dtype, E * T, cfg.scale_dim).view(E, T, cfg.scale_dim)

    # ------------------------------------------------------------------ combine side
    def convert_combine_input(
        self,
        packed_recv_x: torch.Tensor,
        packed_recv_src_info: Optional[torch.Tensor] = None,
        packed_recv_layout_range: Optional[torch.Tensor] = None,
        block_num: int = -1,
        warp_per_block: int = -1,
    ) -> torch.Tensor:
        """Sum each received token's rows of ``packed_recv_x`` ``[E, T, hidden]`` (bf16/fp32),
        weighted by its gating weights, into the registered combine input.

        Returns the view ``[max_num_tokens_to_recv(), hidden]`` of the registered buffer (rows in
        dispatch-output order) for ``combine(...)`` in either mode. ``packed_recv_src_info`` and
        ``packed_recv_layout_range`` are accepted for MORI's signature and not read (the op knows
        the layout of its current dispatch). Needs a standard-MoE layout of the current dispatch.
        """
        self._require_standard_moe_kernels()
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, -1, warp_per_block)
        if self._dispatch_tokens is None:
            raise RuntimeError("convert_combine_input() needs a preceding dispatch")
        h = check_packed_input(self.config, "packed_recv_x", packed_recv_x, COMBINE_DTYPES, self.device)
        self._ensure_standard_moe()
        p = self._launches.get("combine_push", self._dispatch_tokens, block_num, warp_per_block)
        self._launch_std(
            self._handle.launch_convert_combine_input,
            packed_recv_x.data_ptr(), _COMBINE_DTYPE_CODE[packed_recv_x.dtype], h, p.block_num, p.warp_per_block,
            self._stream(),
        )
        return self.get_registered_combine_input_buffer(packed_recv_x.dtype, h)

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
        """Combine expert outputs given in the 3-D layout ``input`` ``[E, T, hidden]`` (bf16/fp32).

        Each received token's expert rows are weighted by its gating weights (those given to
        dispatch; 1 without) and summed while being pushed back, then every rank sums its tokens'
        rows over ranks (FP8 transport per ``quant_type``). ``indices`` is this rank's own routing
        given to dispatch; ``weights`` is accepted for MORI's signature (None or
        ``[num_tokens, topk]`` float32) and not applied again.

        Returns ``(out [max_num_inp_token_per_rank, hidden], None)`` (a view; rows
        ``[0, num_tokens)`` valid).
        """
        self._require_standard_moe_kernels()
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        if self._dispatch_tokens is None:
            raise RuntimeError("combine_standard_moe() needs a preceding dispatch_standard_moe()")
        cfg = self.config
        h = check_packed_input(cfg, "input", input, COMBINE_DTYPES, self.device)
        n = self._dispatch_tokens
        if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or tuple(indices.shape) != (n, cfg.num_experts_per_token):
            raise ValueError(
                f"indices must be this rank's own routing passed to dispatch, int32 [{n}, {cfg.num_experts_per_token}]; "
                f"got {getattr(indices, 'dtype', None)} {tuple(getattr(indices, 'shape', ()))}"
            )
        if indices.device != self.device or not indices.is_contiguous():
            raise ValueError(f"indices must be contiguous on {self.device}")
        check_unused_weights(weights, n, cfg.num_experts_per_token)
        self._ensure_standard_moe()
        p = self._launches.get("combine_push", n, block_num, warp_per_block)
        self._cached_combine_launch = p
        self._launch_std(
            self._handle.launch_combine_standard_moe,
            input.data_ptr(), _COMBINE_DTYPE_CODE[input.dtype], h, indices.data_ptr(), n, p.block_num, p.warp_per_block,
            self._stream(),
        )
        out = typed_view(self._bufs["combine_out"], input.dtype, cfg.max_num_inp_token_per_rank, h)
        if call_reset:
            self.reset()
        return out, None

    def standard_moe_tokens_per_expert(self) -> int:
        """Rows per local expert of the 3-D layout (``world_size * max_num_inp_token_per_rank``)."""
        return tokens_per_expert(self.config)
