"""The MORI-EP operator: one front door (:class:`EpDispatchCombineOp`) over pluggable kernel engines.

The op holds the MORI API once: argument checks, names, shapes and return tuples, the split
send/recv calls, the standard-MoE entry points, profiler access, launch-parameter caching, the
eager host fast path and error reporting. The data movement is an engine's
(:mod:`mori_core.ops.engines`; interface: :class:`~mori_core.ops.engines.base.EpEngine`):

* ``IntraNode`` / ``IntraNodeLL``: CUDA-IPC symmetric memory + NVLink kernels (:mod:`.engines.intranode`);
* ``InterNode`` / ``InterNodeV1`` / ``InterNodeV1LL`` / ``AsyncLL``: NVSHMEM across nodes
  (:mod:`.engines.internode`; the op is then an :class:`InterNodeEpDispatchCombineOp`);
* the plain-torch reference over torch.distributed (:mod:`.engines.reference`), the engine of
  :class:`~mori_core.ops.ReferenceEpDispatchCombineOp`.

An engine module is imported only when a config selects it. The GPU engines never synchronise
the host inside ``dispatch``/``combine``, so both can be captured in CUDA graphs. Failures seen by
their kernels (a peer that never arrives within the timeout, receive-capacity overflow, combine
rows/routing that do not match the dispatch) are written to a host-visible error record; the next
call on the op (or :meth:`EpDispatchCombineOp.check_error`) raises :class:`EpOpError` with the
description, and the op stays failed (recreate it on every rank).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mori_core.ops.call_cache import RowBuffer, typed_view
from mori_core.ops.config import (
    INTERNODE_KERNEL_TYPES,
    EpDispatchCombineConfig,
    decode_src_token_pos,
    normalize_kernel_type,
)
from mori_core.ops.engines.base import CombineOutputs, DispatchOutputs, EpEngine
from mori_core.ops.engines.gpu_common import DEFAULT_TIMEOUT_MS, TIMEOUT_ENV, gpu_ops_available
from mori_core.ops.engines.gpu_common import byte_view as _byte_view  # noqa: F401 - kept for older callers
from mori_core.ops.errors import EpOpError
from mori_core.ops.launch_config import LaunchParams
from mori_core.ops.standard_moe_layout import StdOutputs, check_unused_weights, tokens_per_expert
from mori_core.ops.validation import (
    COMBINE_DTYPE_CODES,
    DISPATCH_DTYPES,
    check_combine_args,
    check_dispatch_args,
    check_launch_overrides,
    resolve_combine_mode,
)

__all__ = [
    "DEFAULT_TIMEOUT_MS",
    "TIMEOUT_ENV",
    "EpDispatchCombineOp",
    "EpOpError",
    "InterNodeEpDispatchCombineOp",
    "gpu_ops_available",
]
# The fast accept compares tensors' device index with the op's; engines without the fast accept
# get one no tensor reports (CPU tensors report -1), so every call takes the full validators.
_NO_FAST_ACCEPT = -2
_PlanKey = tuple[str, int, int, int, int]
_I32, _F32 = torch.int32, torch.float32  # module constants: the fast accept compares dtypes by identity


def _open_device_engine(config: EpDispatchCombineConfig, internode: bool) -> EpEngine:
    """The GPU engine of ``config.kernel_type`` (its module imported only now)."""
    if internode or normalize_kernel_type(config.kernel_type) in INTERNODE_KERNEL_TYPES:
        from mori_core.ops.engines.internode import InterNodeEngine

        return InterNodeEngine(config)
    from mori_core.ops.engines.intranode import IntraNodeEngine

    return IntraNodeEngine(config)


class EpDispatchCombineOp:
    """Expert-parallel dispatch/combine (MORI's API) on the engine of ``config.kernel_type``.

    The GPU engines require :func:`mori_core.shmem.shmem_torch_process_group_init` (or
    ``shmem_init_attr``) on every rank first, with ``config.rank``/``config.world_size`` equal to
    the shmem rank/size. Construction is collective: every rank must create its ops in the same
    order. Inter-node kernel types return an :class:`InterNodeEpDispatchCombineOp`.
    """

    def __new__(cls, config: EpDispatchCombineConfig) -> "EpDispatchCombineOp":
        """Inter-node kernel types get the :class:`InterNodeEpDispatchCombineOp` face."""
        if cls is EpDispatchCombineOp and normalize_kernel_type(config.kernel_type) in INTERNODE_KERNEL_TYPES:
            return super().__new__(InterNodeEpDispatchCombineOp)
        return super().__new__(cls)

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        config.validate()
        self._bind(config, _open_device_engine(config, isinstance(self, InterNodeEpDispatchCombineOp)))

    def _bind(self, config: EpDispatchCombineConfig, engine: EpEngine) -> None:
        """Read the engine's traits and bind its calls once (the hot path then looks nothing up)."""
        self.config = config
        self.kernel_type = normalize_kernel_type(config.kernel_type)
        self._engine = engine
        self.device = engine.device
        self._handle = engine.handle
        self.launch_config_mode = engine.launch_config_mode
        self._arg_device = engine.arg_device
        self._fast_dev_index = engine.device.index if engine.fast_accept else _NO_FAST_ACCEPT
        self._dev_index = self._fast_dev_index  # what the fast accept compares (off: _NO_FAST_ACCEPT)
        self._row_align = engine.row_align
        self._combine_dtypes = engine.combine_dtypes
        self._split = engine.split_phases
        self._failure = engine.failure
        self._resolve_launch = engine.resolve_launch
        self._launch_dispatch = engine.launch_dispatch
        self._finish_dispatch = engine.finish_dispatch
        self._launch_combine = engine.launch_combine
        self._finish_combine = engine.finish_combine
        # Constants the fast argument checks compare against.
        self._max_recv = config.max_num_tokens_to_recv()
        self._max_tok = config.max_num_inp_token_per_rank
        self._topk = topk = config.num_experts_per_token
        self._scale_dim = config.scale_dim
        self._scale_size = config.scale_type_size
        self._push_default = bool(config.use_external_inp_buf)
        # Views of the engine's buffers, built once (engines that return fresh outputs have none).
        self._bufs = bufs = engine.buffer_views()
        has = lambda name: bufs.get(name) is not None  # noqa: E731
        self._out_weights = typed_view(bufs["dispatch_out_weights"], torch.float32, self._max_recv, topk) \
            if has("dispatch_out_weights") else None
        self._out_indices = typed_view(bufs["dispatch_out_indices"], torch.int32, self._max_recv, topk) \
            if has("dispatch_out_indices") else None
        self._combine_out_weights = typed_view(bufs["combine_out_weights"], torch.float32, self._max_tok, topk) \
            if has("combine_out_weights") else None
        self._total_recv = bufs["total_recv"].view(torch.int32)[:1] if has("total_recv") else None
        self.local_expert_count = torch.zeros(config.num_experts_per_rank, dtype=torch.int32, device=self.device)
        # Per-key caches: launch plans, output views per (dtype, hidden), scale/registered views.
        self._plans: dict[_PlanKey, LaunchParams] = {}
        self._dispatch_rows: dict[tuple[torch.dtype, int], RowBuffer] = {}
        self._combine_rows: dict[tuple[torch.dtype, int], RowBuffer] = {}
        self._scale_views: dict[torch.dtype, torch.Tensor] = {}
        self._registered_views: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        # Call state. _dispatch_tokens is the token count of the last completed dispatch, and None
        # while a split send (AsyncLL) awaits its recv: combine's hot path then needs one check.
        self._dispatch_tokens: Optional[int] = None
        self._pending_dispatch: Optional[tuple[LaunchParams, int]] = None  # (plan, tokens) of a split send
        self._pending_combine: Optional[tuple[LaunchParams, int]] = None
        self._count_after_recv = False
        self._cached_dispatch_launch: Optional[LaunchParams] = None
        self._cached_combine_launch: Optional[LaunchParams] = None

    # ------------------------------------------------------------------ sizes
    def max_num_tokens_to_recv(self) -> int:
        """Rows of every dispatch output (receive capacity)."""
        return self._max_recv

    def max_num_tokens_to_recv_per_rank(self) -> int:
        """Per-source share of the receive capacity."""
        return self.config.max_num_tokens_to_recv_per_rank()

    def max_num_tokens_to_send(self) -> int:
        """Stride of the flat source index (``world_size * max_num_inp_token_per_rank``)."""
        return self.config.max_num_tokens_to_send()

    def max_num_tokens_to_send_per_rank(self) -> int:
        """Most rows one rank sends to one peer."""
        return self.config.max_num_tokens_to_send_per_rank()

    def decode_send_flat_idx(self, flat_idx: int) -> tuple[int, int]:
        """``(src_rank, src_token)`` of an entry of :meth:`get_dispatch_src_token_pos`."""
        return decode_src_token_pos(self.config, flat_idx)

    @property
    def timeout_ms(self) -> int:
        """Bound of every spin-wait in the kernels (default ``MORI_EP_TIMEOUT_MS`` or 10 s)."""
        return self._engine.timeout_ms

    @timeout_ms.setter
    def timeout_ms(self, value: int) -> None:
        if int(value) <= 0:
            raise ValueError(f"timeout_ms must be positive, got {value}")
        self._engine.timeout_ms = int(value)

    # ------------------------------------------------------------------ launch parameters
    def _plan(self, kernel: str, num_tokens: int, block_num: int, rdma_block_num: int, warp_per_block: int) -> LaunchParams:
        """The engine's launch for these arguments, resolved once per key (a key's answer never
        changes: the AUTO tables and config defaults are fixed for the op's lifetime)."""
        key = (kernel, num_tokens, block_num, rdma_block_num, warp_per_block)
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = self._resolve_launch(kernel, num_tokens, block_num, rdma_block_num, warp_per_block)
        return p

    def _std_plan(self, kernel: str, num_tokens: int, block_num: int, warp_per_block: int) -> LaunchParams:
        """:meth:`_plan` as the standard-MoE parts call it (no network blocks)."""
        return self._plan(kernel, num_tokens, block_num, -1, warp_per_block)

    def get_launch_config(self, is_dispatch: bool = True, num_tokens: int = 0, zero_copy: bool = False) -> LaunchParams:
        """The (block_num, warp_per_block) a call without overrides would use."""
        kernel = "dispatch" if is_dispatch else ("combine_pull" if zero_copy else "combine_push")
        p = self._plan(kernel, num_tokens, -1, -1, -1)
        return LaunchParams(p.block_num, p.warp_per_block)

    # ------------------------------------------------------------------ errors
    def check_error(self, synchronize: bool = True) -> None:
        """Raise :class:`EpOpError` if a kernel of this op reported a failure.

        With ``synchronize`` the current stream is synchronised first, so failures of calls
        already issued are seen; without it only failures recorded so far are.
        """
        if synchronize:
            self._engine.synchronize()
        msg = self._engine.error_message()
        if msg:
            raise EpOpError(msg)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                 indices: torch.Tensor, block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1,
                 call_local_expert_count: bool = False) -> DispatchOutputs:
        """Send every token once to each unique rank among its top-k experts.

        Args:
            input: ``[num_tokens, hidden]`` bf16/fp16/fp32/fp8 tokens (``hidden <= config.hidden_dim``).
            weights: ``[num_tokens, topk]`` float32 gating weights, or None.
            scales: ``[num_tokens, scale_dim]`` per-token scales (element size
                ``config.scale_type_size``), or None / empty when ``scale_dim == 0``.
            indices: ``[num_tokens, topk]`` int32 expert ids; -1 and ids >= ``num_experts``
                are dropped.
            block_num, warp_per_block: launch overrides (> 0), see :mod:`launch_config`.
            rdma_block_num: network blocks of the inter-node V1/V1LL kernels (ignored elsewhere).
            call_local_expert_count: also fill :attr:`local_expert_count` (received rows per
                local expert).

        Returns:
            ``(out[max_recv, hidden], out_weights[max_recv, topk] f32, out_scales[max_recv,
            scale_dim] or None, out_indices[max_recv, topk] int32, total_recv[1] int32)``: valid
            rows ``total_recv[0]``; :meth:`get_dispatch_src_token_pos` tells each row's source.
            The GPU engines return views of the op's receive buffers, in arrival order, which the
            next dispatch overwrites; the reference returns new tensors ordered by source rank,
            then source token.
        """
        if block_num != -1 or rdma_block_num != -1 or warp_per_block != -1:
            check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        rows = self._accepted_rows(input, weights, scales, indices)
        if rows is None:  # (also while a split send is pending: it turns the fast accept off)
            rows = self._validate_dispatch(input, weights, scales, indices)
            if self._pending_dispatch is not None:
                raise RuntimeError("dispatch_send() was called twice without dispatch_recv()")
        n = input.shape[0]
        p = self._plans.get(("dispatch", n, block_num, rdma_block_num, warp_per_block))
        if p is None:
            p = self._plan("dispatch", n, block_num, rdma_block_num, warp_per_block)
        self._cached_dispatch_launch = p
        has_scales = scales is not None and self._scale_dim > 0
        try:
            res = self._launch_dispatch(input, weights, scales if has_scales else None, indices, n, rows.row_bytes, p, True)
        except self._failure as e:
            raise EpOpError(str(e)) from None
        self._dispatch_tokens = n
        if res is None:  # the engine wrote into its buffers: the views built once
            res = (rows.view, self._out_weights, self._scale_view(scales.dtype) if has_scales else None,
                   self._out_indices, self._total_recv)
        if call_local_expert_count:
            self._count_local_experts(res[3], res[4])
        return res

    def _accepted_rows(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                       indices: torch.Tensor) -> Optional[RowBuffer]:
        """The dispatch's fast accept: the prepared output rows when the arguments match them
        exactly (dtypes by identity, shapes, contiguity, device index), else None (the caller then
        runs the full validators, which raise naming the argument and the limit)."""
        topk, dev, scale_dim = self._topk, self._dev_index, self._scale_dim
        try:
            n, h = input.shape
            rows = self._dispatch_rows.get((input.dtype, h))
            ok = (
                rows is not None
                and n <= self._max_tok
                and input.is_contiguous()
                and input.get_device() == dev
                and indices.dtype is _I32  # tensor_matches, inlined (a Python call per check is measurable)
                and indices.shape == (n, topk)
                and indices.is_contiguous()
                and indices.get_device() == dev
                and (
                    weights is None
                    or (
                        weights.dtype is _F32
                        and weights.shape == (n, topk)
                        and weights.is_contiguous()
                        and weights.get_device() == dev
                    )
                )
                and (
                    scales is None
                    if scale_dim == 0
                    else scales is None
                    or (
                        scales.shape == (n, scale_dim)
                        and scales.element_size() == self._scale_size
                        and scales.is_contiguous()
                        and scales.get_device() == dev
                    )
                )
            )
        except (AttributeError, TypeError, ValueError):
            return None
        return rows if ok else None

    def _validate_dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                           indices: torch.Tensor) -> RowBuffer:
        """Full dispatch validation (raises with the argument and the limit); on success returns
        the output view for the input's (dtype, hidden), built on first use."""
        args = check_dispatch_args(
            self.config, input, weights, scales, indices, device=self._arg_device, allowed_dtypes=DISPATCH_DTYPES
        )
        row_bytes = args.hidden_dim * input.element_size()
        align = self._row_align
        if row_bytes % align:
            raise ValueError(
                f"input rows must be a multiple of {align} bytes (hidden {args.hidden_dim} x {input.element_size()} B "
                f"= {row_bytes} B) for the {align}-byte vector copies"
            )
        key = (input.dtype, args.hidden_dim)
        rows = self._dispatch_rows.get(key)
        if rows is None:
            buf = self._bufs.get("dispatch_out")
            view = None if buf is None else typed_view(buf, input.dtype, self._max_recv, args.hidden_dim)
            rows = self._dispatch_rows[key] = RowBuffer(view, row_bytes, -1)
        return rows

    def _scale_view(self, dtype: torch.dtype) -> torch.Tensor:
        """``[max_recv, scale_dim]`` view of the received scales in ``dtype`` (built once)."""
        v = self._scale_views.get(dtype)
        if v is None:
            v = typed_view(self._bufs["dispatch_out_scales"], dtype, self._max_recv, self.config.scale_dim)
            self._scale_views[dtype] = v
        return v

    def _count_local_experts(self, out_indices: torch.Tensor, total_recv: torch.Tensor) -> None:
        """Received rows per local expert, with device ops only (no host sync; graph-safe)."""
        cfg = self.config
        lo = cfg.rank * cfg.num_experts_per_rank
        rows = torch.arange(self._max_recv, device=self.device).view(-1, 1) < total_recv
        local = (out_indices >= lo) & (out_indices < lo + cfg.num_experts_per_rank) & rows
        slot = (out_indices - lo).clamp(0, cfg.num_experts_per_rank - 1).to(torch.int64)
        self.local_expert_count.zero_()
        self.local_expert_count.scatter_add_(0, slot.flatten(), local.flatten().to(torch.int32))

    def dispatch_send(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                      indices: torch.Tensor, block_num: int = -1, warp_per_block: int = -1,
                      call_local_expert_count: bool = False) -> DispatchOutputs:
        """AsyncLL: launch the send half and return the output views (valid after
        :meth:`dispatch_recv`). Every other engine completes the exchange here (:meth:`dispatch`)."""
        if not self._split:
            return self.dispatch(input, weights, scales, indices, block_num=block_num, warp_per_block=warp_per_block,
                                 call_local_expert_count=call_local_expert_count)
        check_launch_overrides(block_num, -1, warp_per_block)
        if self._pending_dispatch is not None:
            raise RuntimeError("dispatch_send() was called twice without dispatch_recv()")
        rows = self._validate_dispatch(input, weights, scales, indices)
        n = int(input.shape[0])
        has_scales = scales is not None and self._scale_dim > 0
        p = self._cached_dispatch_launch = self._plan("dispatch", n, block_num, -1, warp_per_block)
        self._launch_dispatch(input, weights, scales if has_scales else None, indices, n, rows.row_bytes, p, False)
        self._pending_dispatch, self._count_after_recv, self._dispatch_tokens = (p, n), call_local_expert_count, None
        self._dev_index = _NO_FAST_ACCEPT  # dispatch() must take the full path, which refuses a second send
        return (rows.view, self._out_weights, self._scale_view(scales.dtype) if has_scales else None,
                self._out_indices, self._total_recv)

    def dispatch_recv(
        self, block_num: int = -1, warp_per_block: int = -1, call_local_expert_count: bool = False
    ) -> None:
        """AsyncLL: wait for the other nodes' rows, forward them inside the node and publish
        ``total_recv``. Every other engine has nothing left to do. Returns None."""
        pending = self._pending_dispatch
        if pending is None:
            if self._split or self._dispatch_tokens is None:
                raise RuntimeError("dispatch_recv() needs a preceding dispatch_send()")
            return None
        self._finish_dispatch(pending[0])
        self._pending_dispatch, self._dispatch_tokens = None, pending[1]
        self._dev_index = self._fast_dev_index
        if call_local_expert_count or self._count_after_recv:
            self._count_local_experts(self._out_indices, self._total_recv)
        return None

    # ------------------------------------------------------------------ combine
    def combine(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor,
                block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1,
                use_external_inp_buf: int = -1, call_reset: bool = False) -> CombineOutputs:
        """Return expert outputs to their source ranks and sum them per original token (fp32).

        Args:
            input: ``[rows >= total_recv, hidden]`` expert outputs in dispatch-output order (bf16 or
                fp32; the reference also takes fp16). In pull mode (``use_external_inp_buf=0``) the
                rows are read from :meth:`get_registered_combine_input_buffer` instead; ``input``
                then only gives dtype and hidden size.
            weights: ``[rows >= total_recv, topk]`` float32 rows to sum alongside, or None.
            indices: this rank's own ``[num_tokens, topk]`` int32 routing given to dispatch.
            use_external_inp_buf: -1 = config, 1 = push (copy ``input`` rows to the sources),
                0 = pull (sources read the registered buffer; zero-copy).
            call_reset: accepted for MORI; :meth:`reset` is a no-op (the kernels reset their counters).

        Returns:
            ``(out[max_num_inp_token_per_rank, hidden], out_weights[.., topk] f32 or None)``;
            rows ``[0, num_tokens)`` are valid. Inter-node kernel types sum inside each node
            first (fp32, rounded once to the combine dtype), then across nodes in ascending order.
        """
        if block_num != -1 or rdma_block_num != -1 or warp_per_block != -1:
            check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        n = self._dispatch_tokens
        if n is None:
            self._refuse_combine()
        push = self._push_default if use_external_inp_buf == -1 else resolve_combine_mode(self.config, use_external_inp_buf)
        topk, dev = self._topk, self._dev_index
        try:
            in_rows, h = input.shape
            rows = self._combine_rows.get((input.dtype, h))
            has_weights = weights is not None and weights.numel() > 0
            ok = (
                rows is not None
                and input.is_contiguous()
                and input.get_device() == dev
                and indices.dtype is _I32
                and indices.shape == (n, topk)
                and indices.is_contiguous()
                and indices.get_device() == dev
                and (
                    not has_weights
                    or (
                        weights.dtype is _F32
                        and weights.dim() == 2
                        and weights.shape[1] == topk
                        and weights.is_contiguous()
                        and weights.get_device() == dev
                    )
                )
            )
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            rows, has_weights = self._validate_combine(input, weights, indices, n)
            in_rows = int(input.shape[0])
        kernel = "combine_push" if push else "combine_pull"
        p = self._plans.get((kernel, n, block_num, rdma_block_num, warp_per_block))
        if p is None:
            p = self._plan(kernel, n, block_num, rdma_block_num, warp_per_block)
        self._cached_combine_launch = p
        try:
            res = self._launch_combine(input, weights if has_weights else None, indices, n, rows, in_rows, push, p, True)
        except self._failure as e:
            raise EpOpError(str(e)) from None
        if res is None:  # the engine wrote into its buffers: the views built once
            res = (rows.view, self._combine_out_weights if has_weights else None)
        return res  # call_reset: reset() is a no-op (the kernels reset their counters themselves)

    def _refuse_combine(self) -> None:
        """Raise the RuntimeError that says why no combine can start now."""
        if self._pending_dispatch is not None:
            raise RuntimeError("combine() needs a preceding, completed dispatch() (call dispatch_recv() first)")
        if self._pending_combine is not None:
            raise RuntimeError("combine_send() was called twice without combine_recv()")
        raise RuntimeError("combine() needs a preceding dispatch()")

    def _validate_combine(
        self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor, num_tokens: int
    ) -> tuple[RowBuffer, bool]:
        """Full combine validation (raises with the argument and the limit); on success returns the
        output view for the input's (dtype, hidden), built on first use, and whether weights combine."""
        has_weights = check_combine_args(
            self.config, input, weights, indices, num_tokens, device=self._arg_device,
            allowed_dtypes=self._combine_dtypes,
        )
        h = int(input.shape[1])
        if (h * input.element_size()) % self._row_align:
            raise ValueError(
                f"input rows must be a multiple of {self._row_align} bytes, got hidden {h} x {input.element_size()} B"
            )
        return self._combine_row_buffer(input.dtype, h), has_weights

    def _combine_row_buffer(self, dtype: torch.dtype, hidden: int) -> RowBuffer:
        """The combine output view of (dtype, hidden), built on first use."""
        key = (dtype, hidden)
        rows = self._combine_rows.get(key)
        if rows is None:
            buf = self._bufs.get("combine_out")
            view = None if buf is None else typed_view(buf, dtype, self._max_tok, hidden)
            itemsize = torch.empty(0, dtype=dtype).element_size()
            rows = self._combine_rows[key] = RowBuffer(view, hidden * itemsize, COMBINE_DTYPE_CODES.get(dtype, -1))
        return rows

    def combine_send(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor,
                     block_num: int = -1, warp_per_block: int = -1) -> CombineOutputs:
        """AsyncLL: reduce inside the node and send the partial rows; returns the output views
        (valid after :meth:`combine_recv`). Every other engine: :meth:`combine` with the config's mode."""
        if not self._split:
            return self.combine(input, weights, indices, block_num=block_num, warp_per_block=warp_per_block)
        check_launch_overrides(block_num, -1, warp_per_block)
        n = self._dispatch_tokens
        if n is None:
            self._refuse_combine()
        rows, has_weights = self._validate_combine(input, weights, indices, n)
        kernel = "combine_push" if self._push_default else "combine_pull"
        p = self._cached_combine_launch = self._plan(kernel, n, block_num, -1, warp_per_block)
        self._launch_combine(input, weights if has_weights else None, indices, n, rows, int(input.shape[0]),
                             self._push_default, p, False)
        self._pending_combine, self._dispatch_tokens = (p, n), None
        return rows.view, (self._combine_out_weights if has_weights else None)

    def combine_recv(self, block_num: int = -1, warp_per_block: int = -1) -> None:
        """AsyncLL: wait for the other nodes' partial rows and write the sums. Every other engine
        has nothing left to do. Returns None."""
        pending = self._pending_combine
        if pending is None:
            if self._split:
                raise RuntimeError("combine_recv() needs a preceding combine_send()")
            return None
        self._finish_combine(pending[0])
        self._pending_combine, self._dispatch_tokens = None, pending[1]
        return None

    # ------------------------------------------------------------------ misc
    def get_dispatch_src_token_pos(self) -> torch.Tensor:
        """Synchronise and return int32 ``[total_recv]``: ``src_rank * max_num_tokens_to_send() +
        src_token`` for every received row (MORI's flat index; decode with
        :meth:`decode_send_flat_idx`)."""
        self.check_error(synchronize=True)
        return self._engine.src_token_pos()

    def get_registered_combine_input_buffer(self, dtype: torch.dtype, hidden_dim: int = -1) -> torch.Tensor:
        """View ``[max_num_tokens_to_recv(), hidden_dim]`` of this rank's registered (symmetric)
        combine input buffer. For pull combine write expert outputs here (row = dispatch-output
        row) before calling ``combine(..., use_external_inp_buf=0)``; write it only after the
        dispatch of the same round."""
        h = self.config.hidden_dim if hidden_dim is None or hidden_dim <= 0 else int(hidden_dim)
        view = self._registered_views.get((dtype, h))
        if view is not None:
            return view
        if h > self.config.hidden_dim:
            raise ValueError(f"hidden_dim={h} exceeds config.hidden_dim={self.config.hidden_dim}")
        if dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dtype {dtype} is not supported; use one of {list(DISPATCH_DTYPES)}")
        if torch.empty(0, dtype=dtype).element_size() > self.config.max_token_type_size:
            raise ValueError(f"dtype {dtype} is wider than max_token_type_size={self.config.max_token_type_size}")
        view = self._registered_views[(dtype, h)] = typed_view(self._bufs["combine_input"], dtype, self._max_recv, h)
        return view

    def reset(self) -> None:
        """No-op kept for MORI compatibility: the kernels reset their counters themselves."""
        return None

    # ------------------------------------------------------------------ standard-MoE (3-D layout)
    def _standard_moe_part(self) -> Any:
        """The engine's standard-MoE part (``IntraNodeStandardMoe`` / ``ReferenceStandardMoe``)."""
        std = self._engine.standard_moe
        if std is None:
            raise NotImplementedError(
                f"the standard-MoE layout (dispatch_standard_moe / combine_standard_moe / converters) is implemented "
                f"for the IntraNode kernels, not for kernel_type {self.config.kernel_type}"
            )
        return std

    def _standard_moe_call(self, block_num: int, rdma_block_num: int, warp_per_block: int) -> Any:
        """The engine's standard-MoE part, after the checks every standard-MoE call starts with."""
        std = self._standard_moe_part()
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        return std

    def dispatch_standard_moe(self, input: torch.Tensor, weights: Optional[torch.Tensor],
                              scales: Optional[torch.Tensor], indices: torch.Tensor, block_num: int = -1,
                              rdma_block_num: int = -1, warp_per_block: int = -1) -> StdOutputs:
        """Dispatch straight into the 3-D standard-MoE layout (arguments as :meth:`dispatch`).

        Returns ``(packed_recv_x [E, T, hidden], packed_recv_count [E] int32,
        packed_recv_src_info [E, T] int32, packed_recv_layout_range [E, world] int64)``; layout:
        :mod:`mori_core.ops.standard_moe_layout`. The GPU engine's are views of the op's buffers,
        overwritten by the next standard-MoE dispatch/conversion, and its plain 2-D dispatch
        outputs are not written (``get_dispatch_src_token_pos`` and ``combine`` with rows from
        :meth:`convert_combine_input` still work). Scales (``scale_dim > 0``):
        :meth:`get_packed_recv_scales`.
        """
        std = self._standard_moe_part()
        if not std.fused:  # dispatch, then lay the received rows out
            self.check_error(synchronize=False)
            out, _, _, out_idx, total = self.dispatch(
                input, weights, scales, indices, block_num=block_num, rdma_block_num=rdma_block_num,
                warp_per_block=warp_per_block,
            )
            n = int(total[0])
            return self.convert_dispatch_output(out[:n], out_idx[:n])
        # The dispatch's checks and cached launch (the kernels report a failed op themselves).
        if block_num != -1 or rdma_block_num != -1 or warp_per_block != -1:
            check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        rows = self._accepted_rows(input, weights, scales, indices)
        if rows is None:
            rows = self._validate_dispatch(input, weights, scales, indices)
        n = int(input.shape[0])
        p = self._std_plan("dispatch", n, block_num, warp_per_block)
        res = std.dispatch(input, weights, scales if self._scale_dim > 0 else None, indices, n, rows.row_bytes, p)
        self._dispatch_tokens = n
        return res

    def convert_dispatch_output(self, dispatch_out_x: torch.Tensor, dispatch_out_topk_idx: torch.Tensor,
                                block_num: int = -1, warp_per_block: int = -1) -> StdOutputs:
        """Lay this rank's 2-D dispatch output out as the 3-D layout (same returns as
        :meth:`dispatch_standard_moe`).

        Args:
            dispatch_out_x: ``[rows >= total_recv, hidden]`` received rows in dispatch-output order
                (normally ``dispatch(...)[0]``).
            dispatch_out_topk_idx: ``[rows, topk]`` int32 ids of those rows (``dispatch(...)[3]``).
        Scales of the dispatch are laid out too (:meth:`get_packed_recv_scales`).
        """
        std = self._standard_moe_call(block_num, -1, warp_per_block)
        if self._dispatch_tokens is None:
            raise RuntimeError("convert_dispatch_output() needs a preceding dispatch()")
        return std.convert_dispatch_output(dispatch_out_x, dispatch_out_topk_idx, self._dispatch_tokens, block_num,
                                           warp_per_block, self._std_plan)

    def get_packed_recv_scales(self, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """View ``[E, T, scale_dim]`` of the scales in the 3-D layout, or None when no scales travel.

        ``dtype`` defaults to the dtype of the scales given to :meth:`dispatch_standard_moe`
        (float32 after a plain ``dispatch`` + :meth:`convert_dispatch_output`); its element size
        must be ``config.scale_type_size``.
        """
        return self._standard_moe_part().packed_recv_scales(dtype)

    def convert_combine_input(self, packed_recv_x: torch.Tensor, packed_recv_src_info: Optional[torch.Tensor] = None,
                              packed_recv_layout_range: Optional[torch.Tensor] = None, block_num: int = -1,
                              warp_per_block: int = -1) -> torch.Tensor:
        """Sum each received token's rows of ``packed_recv_x`` ``[E, T, hidden]`` (bf16/fp32),
        weighted by its gating weights, into the registered combine input.

        Returns the view ``[max_num_tokens_to_recv(), hidden]`` of the registered buffer (rows in
        dispatch-output order) for ``combine(...)`` in either mode. ``packed_recv_src_info`` and
        ``packed_recv_layout_range`` are accepted for MORI's signature and not read (the op knows
        the layout of its current dispatch). Needs a standard-MoE layout of the current dispatch.
        """
        std = self._standard_moe_call(block_num, -1, warp_per_block)
        if self._dispatch_tokens is None:
            raise RuntimeError("convert_combine_input() needs a preceding dispatch")
        dtype, h = std.convert_combine_input(packed_recv_x, self._dispatch_tokens, block_num, warp_per_block,
                                             self._std_plan)
        return self.get_registered_combine_input_buffer(dtype, h)

    def combine_standard_moe(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor,
                             block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1,
                             call_reset: bool = False) -> tuple[torch.Tensor, None]:
        """Combine expert outputs given in the 3-D layout ``input`` ``[E, T, hidden]`` (bf16/fp32).

        Each received token's expert rows are weighted by its gating weights (those given to
        dispatch; 1 without) and summed per rank, then every rank sums its tokens' rows over
        ranks (FP8 transport per ``quant_type``). ``indices`` is this rank's own routing given to
        dispatch; ``weights`` is accepted for MORI's signature (None or ``[num_tokens, topk]``
        float32) and not applied again.

        Returns ``(out [max_num_inp_token_per_rank, hidden], None)`` (rows ``[0, num_tokens)`` valid).
        """
        std = self._standard_moe_call(block_num, rdma_block_num, warp_per_block)
        n = self._dispatch_tokens
        if n is None:
            raise RuntimeError("combine_standard_moe() needs a preceding dispatch_standard_moe()")
        if std.fused:
            dtype, h, self._cached_combine_launch = std.combine(input, weights, indices, n, block_num, warp_per_block,
                                                                self._std_plan)
            out = self._combine_row_buffer(dtype, h).view
        else:  # weight and sum the rows into the registered buffer, then a push combine
            check_unused_weights(weights, n, self.config.num_experts_per_token)
            out, _ = self.combine(self.convert_combine_input(input), None, indices, use_external_inp_buf=1)
        if call_reset:
            self.reset()
        return out, None

    def standard_moe_tokens_per_expert(self) -> int:
        """Rows per local expert of the 3-D layout (``world_size * max_num_inp_token_per_rank``)."""
        return tokens_per_expert(self.config)

    # ------------------------------------------------------------------ profiler
    def get_debug_time_buf(self) -> torch.Tensor:
        """The kernel profiler's int64 event buffer (a view, filled as kernels run).

        Raises:
            RuntimeError: in builds without ``MORI_ENABLE_PROFILER``.
            NotImplementedError: for engines the profiler does not cover.
        """
        return self._engine.debug_time_buf()

    def reset_debug_time_buf(self) -> None:
        """Clear the recorded events (synchronises the device; no-op without the profiler)."""
        self._engine.reset_debug_time_buf()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release the op's buffers (GPU engines: collective, call on every rank)."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
            self._bufs = {}
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class InterNodeEpDispatchCombineOp(EpDispatchCombineOp):
    """The op with the inter-node engine (InterNode, InterNodeV1, InterNodeV1LL, AsyncLL; see
    :mod:`mori_core.ops.engines.internode`). Created by ``EpDispatchCombineOp(config)`` for these
    kernel types. Needs :mod:`mori_core.shmem` initialised on all ``world_size`` ranks;
    construction initialises NVSHMEM on first use when the group spans more than one node."""

    @property
    def uses_network(self) -> bool:
        """True when the group spans several nodes (NVSHMEM carries the inter-node rows)."""
        return self._engine.uses_network
