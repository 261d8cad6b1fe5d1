"""GPU MORI-EP operator: IntraNode dispatch/combine over CUDA IPC symmetric memory.

The compiled core owns the kernels and buffers; this wrapper validates tensors, resolves launch
parameters and turns the op's buffers into torch views. It never synchronises the host inside
``dispatch``/``combine``, so both can be captured in CUDA graphs.

Failures seen by the kernels (a peer that never arrives within the timeout, receive-capacity
overflow, combine rows/routing that do not match the dispatch) are written to a host-visible
error record; the next call on the op (or :meth:`EpDispatchCombineOp.check_error`) raises
:class:`EpOpError` with the description, and the op stays failed (recreate it on every rank).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from mori_core.ops.config import (
    IMPLEMENTED_KERNEL_TYPES,
    INTERNODE_KERNEL_TYPES,
    EpDispatchCombineConfig,
    decode_src_token_pos,
    normalize_kernel_type,
)
from mori_core.ops.call_cache import LaunchCache, RowBuffer, stream_handle_getter, tensor_matches, typed_view
from mori_core.ops.combine_quant import combine_quant_code
from mori_core.ops.launch_config import LaunchParams, launch_mode
from mori_core.ops.profiler import ProfilerMixin
from mori_core.ops.standard_moe import StandardMoeMixin
from mori_core.ops.validation import (
    COMBINE_DTYPES,
    DISPATCH_DTYPES,
    check_combine_args,
    check_dispatch_args,
    check_launch_overrides,
    resolve_combine_mode,
)

TIMEOUT_ENV = "MORI_EP_TIMEOUT_MS"
DEFAULT_TIMEOUT_MS = 10_000
_COMBINE_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 1}


class EpOpError(RuntimeError):
    """A dispatch/combine kernel reported a failure; the op is unusable afterwards."""


def gpu_ops_available() -> tuple[bool, str]:
    """(True, "") when this build has the GPU EP kernels and a GPU is visible, else (False, why)."""
    try:
        from mori_core import _C
    except ImportError as e:  # pragma: no cover - broken install
        return False, f"mori_core._C failed to import: {e}"
    info = _C.build_info()
    if not info.get("ops"):
        return False, (
            "this mori_core build has no GPU EP kernels (built without nvcc/hipcc); "
            "use ReferenceEpDispatchCombineOp on CPU or rebuild with a CUDA toolkit"
        )
    if _C.gpu_device_count() < 1:
        return False, "no GPU is visible to mori_core (ReferenceEpDispatchCombineOp runs without one)"
    return True, ""


class _CudaBuffer:
    """Exposes raw device memory through __cuda_array_interface__ so torch can view it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _byte_view(ptr: int, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
    if ptr == 0 or nbytes == 0:
        return None
    return torch.as_tensor(_CudaBuffer(ptr, nbytes), device=device)


class EpDispatchCombineOp(StandardMoeMixin, ProfilerMixin):
    """IntraNode expert-parallel dispatch/combine on the GPUs of one node (MORI's API).

    Requires :func:`mori_core.shmem.shmem_torch_process_group_init` (or ``shmem_init_attr``)
    on every rank first, with ``config.rank``/``config.world_size`` equal to the shmem
    rank/size. Construction is collective: every rank must create its ops in the same order.
    """

    def __new__(cls, config: EpDispatchCombineConfig) -> "EpDispatchCombineOp":
        """Inter-node kernel types are served by ``mori_core.ops.internode.InterNodeEpDispatchCombineOp``."""
        if cls is EpDispatchCombineOp and normalize_kernel_type(config.kernel_type) in INTERNODE_KERNEL_TYPES:
            from mori_core.ops.internode import InterNodeEpDispatchCombineOp

            return super().__new__(InterNodeEpDispatchCombineOp)
        return super().__new__(cls)

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        config.validate()
        kt = normalize_kernel_type(config.kernel_type)
        if kt not in IMPLEMENTED_KERNEL_TYPES:
            raise NotImplementedError(
                f"kernel_type {kt.name} is not implemented by mori_core; this build provides IntraNode "
                "(and IntraNodeLL, which runs the IntraNode kernels) for EP within one node"
            )
        combine_quant = combine_quant_code(config)  # FP8 transport of combine rows (combine_quant.py)
        ok, why = gpu_ops_available()
        if not ok:
            raise RuntimeError(f"EpDispatchCombineOp needs the GPU build: {why}")
        from mori_core import _C
        from mori_core import shmem

        shmem.require_initialized(config.rank, config.world_size)
        self.config = config
        self.device = torch.device("cuda", shmem.shmem_device())
        timeout_ms = int(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_MS))
        if timeout_ms <= 0:
            raise ValueError(f"{TIMEOUT_ENV} must be a positive number of milliseconds, got {timeout_ms}")
        self._handle = _C.EpDispatchCombineHandle(
            rank=config.rank,
            world_size=config.world_size,
            hidden_dim=config.hidden_dim,
            scale_dim=config.scale_dim,
            scale_type_size=config.scale_type_size if config.scale_dim > 0 else 0,
            max_token_type_size=config.max_token_type_size,
            max_num_inp_token_per_rank=config.max_num_inp_token_per_rank,
            num_experts_per_rank=config.num_experts_per_rank,
            num_experts_per_token=config.num_experts_per_token,
            max_num_tokens_to_recv=config.max_num_tokens_to_recv(),
            timeout_ms=timeout_ms,
        )
        # Every rank must have placed the op's buffers at the same heap offset, and all ranks
        # must have zeroed them before any peer writes: one collective check does both.
        shmem.verify_symmetric("ep_op_offset", self._handle.heap_offset())
        self._handle.set_combine_quant(combine_quant)
        bufs = self._adopt_buffers(config)
        self.launch_config_mode = launch_mode()
        self._sm_count = int(self._handle.sm_count)
        self._arch_major = int(self._handle.arch_major)
        self._dispatch_tokens: Optional[int] = None
        self._cached_dispatch_launch: Optional[LaunchParams] = None
        self._cached_combine_launch: Optional[LaunchParams] = None
        # Prepared once for the hot path (see call_cache): fixed views, views per (dtype, hidden),
        # resolved launch parameters, and the constants the fast argument checks compare against.
        self._dev_index = self.device.index
        self._failure = _C.EpOpFailure
        self._handle_addr = int(self._handle.address)  # 0 once closed (the fast calls refuse it)
        self._launch_dispatch = _C.ep_launch_dispatch
        self._launch_combine = _C.ep_launch_combine
        self._stream_of = stream_handle_getter()
        self._launches = LaunchCache(
            config.block_num, config.warp_num_per_block, self._sm_count, self._arch_major,
            self.launch_config_mode, config.world_size,
        )
        topk = config.num_experts_per_token
        self._out_weights = typed_view(bufs["dispatch_out_weights"], torch.float32, self._max_recv, topk)
        self._out_indices = typed_view(bufs["dispatch_out_indices"], torch.int32, self._max_recv, topk)
        self._out_weights_ptr = self._out_weights.data_ptr()
        self._combine_out_weights = typed_view(
            bufs["combine_out_weights"], torch.float32, config.max_num_inp_token_per_rank, topk
        )
        self._dispatch_rows: dict[tuple[torch.dtype, int], RowBuffer] = {}
        self._combine_rows: dict[tuple[torch.dtype, int], RowBuffer] = {}
        self._scale_views: dict[torch.dtype, torch.Tensor] = {}
        self._push_default = bool(config.use_external_inp_buf)
        self._max_tok = config.max_num_inp_token_per_rank
        self._topk = topk
        self._scale_dim = config.scale_dim
        self._scale_size = config.scale_type_size

    def _adopt_buffers(self, config: EpDispatchCombineConfig) -> dict[str, torch.Tensor]:
        """Byte views of the handle's buffers and the state every op type shares over them
        (receive count, source positions, local expert counts, registered-input views)."""
        bufs = {name: _byte_view(ptr, size, self.device) for name, (ptr, size) in self._handle.buffers().items()}
        self._bufs = bufs
        self._max_recv = config.max_num_tokens_to_recv()
        self._total_recv = bufs["total_recv"].view(torch.int32)[:1]
        self._src_pos = bufs["src_pos"].view(torch.int32)
        self.local_expert_count = torch.zeros(config.num_experts_per_rank, dtype=torch.int32, device=self.device)
        self._registered_views: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        return bufs

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
        return int(self._handle.timeout_ms)

    @timeout_ms.setter
    def timeout_ms(self, value: int) -> None:
        if int(value) <= 0:
            raise ValueError(f"timeout_ms must be positive, got {value}")
        self._handle.timeout_ms = int(value)

    def get_launch_config(self, is_dispatch: bool = True, num_tokens: int = 0, zero_copy: bool = False) -> LaunchParams:
        """The (block_num, warp_per_block) a call without overrides would use."""
        kernel = "dispatch" if is_dispatch else ("combine_pull" if zero_copy else "combine_push")
        return self._launches.get(kernel, num_tokens, -1, -1)

    # ------------------------------------------------------------------ errors
    def check_error(self, synchronize: bool = True) -> None:
        """Raise :class:`EpOpError` if a kernel of this op reported a failure.

        With ``synchronize`` the current stream is synchronised first, so failures of calls
        already issued are seen; without it only failures recorded so far are.
        """
        if synchronize:
            torch.cuda.current_stream(self.device).synchronize()
        msg = self._handle.error_message()
        if msg:
            raise EpOpError(msg)

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        scales: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        call_local_expert_count: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Send every token once to each unique rank among its top-k experts.

        Args:
            input: ``[num_tokens, hidden]`` bf16/fp16/fp32/fp8 tokens (``hidden <= config.hidden_dim``).
            weights: ``[num_tokens, topk]`` float32 gating weights, or None.
            scales: ``[num_tokens, scale_dim]`` per-token scales (element size
                ``config.scale_type_size``), or None / empty when ``scale_dim == 0``.
            indices: ``[num_tokens, topk]`` int32 expert ids; -1 and ids >= ``num_experts``
                are dropped.
            block_num, warp_per_block: launch overrides (> 0), see :mod:`launch_config`.
            rdma_block_num: accepted for API parity (inter-node kernels only).
            call_local_expert_count: also fill :attr:`local_expert_count` (received rows per
                local expert).

        Returns:
            ``(out[max_recv, hidden], out_weights[max_recv, topk] f32, out_scales[max_recv,
            scale_dim] or None, out_indices[max_recv, topk] int32, total_recv[1] int32)``:
            views of the op's receive buffers, valid rows ``total_recv[0]``, in arrival order
            (:meth:`get_dispatch_src_token_pos` tells each row's source). They are overwritten by
            the next dispatch.
        """
        if block_num != -1 or rdma_block_num != -1 or warp_per_block != -1:
            check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        topk, dev, scale_dim = self._topk, self._dev_index, self._scale_dim
        # Fast accept (exact dtypes/shapes/layout against what was prepared); anything else is
        # handed to the full validators, which raise naming the argument and the limit.
        try:
            n, h = input.shape
            rows = self._dispatch_rows.get((input.dtype, h))
            ok = (
                rows is not None
                and n <= self._max_tok
                and input.is_contiguous()
                and input.get_device() == dev
                and tensor_matches(indices, torch.int32, (n, topk), dev)
                and (weights is None or tensor_matches(weights, torch.float32, (n, topk), dev))
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
            ok = False
        if not ok:
            rows = self._validate_dispatch(input, weights, scales, indices)
            n = int(input.shape[0])
        has_scales = scales is not None and scale_dim > 0
        p = self._launches.get("dispatch", n, block_num, warp_per_block)
        self._cached_dispatch_launch = p
        try:
            self._launch_dispatch(
                self._handle_addr,
                input.data_ptr(),
                rows.row_bytes,
                n,
                # An empty weights tensor (a rank with no tokens) has address 0, but the address also
                # says whether this round carries weights: receivers weight standard-MoE rows by it.
                0 if weights is None else (weights.data_ptr() or self._out_weights_ptr),
                scales.data_ptr() if has_scales else 0,
                indices.data_ptr(),
                p.block_num,
                p.warp_per_block,
                self._stream_of(dev),
            )
        except self._failure as e:
            raise EpOpError(str(e)) from None
        self._dispatch_tokens = n
        out_scales = self._scale_view(scales.dtype) if has_scales else None
        if call_local_expert_count:
            self._count_local_experts(self._out_indices)
        return rows.view, self._out_weights, out_scales, self._out_indices, self._total_recv

    def _validate_dispatch(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        scales: Optional[torch.Tensor],
        indices: torch.Tensor,
    ) -> RowBuffer:
        """Full dispatch validation (raises with the argument and the limit); on success returns
        the output view for the input's (dtype, hidden), built on first use."""
        args = check_dispatch_args(
            self.config, input, weights, scales, indices, device=self.device, allowed_dtypes=DISPATCH_DTYPES
        )
        row_bytes = args.hidden_dim * input.element_size()
        if row_bytes % 16:
            raise ValueError(
                f"input rows must be a multiple of 16 bytes (hidden {args.hidden_dim} x {input.element_size()} B "
                f"= {row_bytes} B) for the 16-byte vector copies"
            )
        key = (input.dtype, args.hidden_dim)
        rows = self._dispatch_rows.get(key)
        if rows is None:
            view = typed_view(self._bufs["dispatch_out"], input.dtype, self._max_recv, args.hidden_dim)
            rows = self._dispatch_rows[key] = RowBuffer(view, row_bytes, -1)
        return rows

    def _scale_view(self, dtype: torch.dtype) -> torch.Tensor:
        """``[max_recv, scale_dim]`` view of the received scales in ``dtype`` (built once)."""
        v = self._scale_views.get(dtype)
        if v is None:
            v = typed_view(self._bufs["dispatch_out_scales"], dtype, self._max_recv, self.config.scale_dim)
            self._scale_views[dtype] = v
        return v

    def _count_local_experts(self, out_indices: torch.Tensor) -> None:
        """Received rows per local expert, with device ops only (no host sync; graph-safe)."""
        cfg = self.config
        lo = cfg.rank * cfg.num_experts_per_rank
        rows = torch.arange(self._max_recv, device=self.device).view(-1, 1) < self._total_recv
        local = (out_indices >= lo) & (out_indices < lo + cfg.num_experts_per_rank) & rows
        slot = (out_indices - lo).clamp(0, cfg.num_experts_per_rank - 1).to(torch.int64)
        self.local_expert_count.zero_()
        self.local_expert_count.scatter_add_(0, slot.flatten(), local.flatten().to(torch.int32))

    def dispatch_send(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        scales: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        warp_per_block: int = -1,
        call_local_expert_count: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Same as :meth:`dispatch` (IntraNode completes the exchange in one kernel)."""
        return self.dispatch(
            input,
            weights,
            scales,
            indices,
            block_num=block_num,
            warp_per_block=warp_per_block,
            call_local_expert_count=call_local_expert_count,
        )

    def dispatch_recv(
        self, block_num: int = -1, warp_per_block: int = -1, call_local_expert_count: bool = False
    ) -> None:
        """Nothing left to do after :meth:`dispatch_send` for IntraNode; returns None."""
        if self._dispatch_tokens is None:
            raise RuntimeError("dispatch_recv() needs a preceding dispatch_send()")
        return None

    # ------------------------------------------------------------------ combine
    def combine(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        use_external_inp_buf: int = -1,
        call_reset: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return expert outputs to their source ranks and sum them per original token (fp32).

        Args:
            input: ``[rows >= total_recv, hidden]`` bf16/fp32 expert outputs in dispatch-output
                order. In pull mode (``use_external_inp_buf=0``) the rows are read from
                :meth:`get_registered_combine_input_buffer` instead; ``input`` then only gives
                dtype and hidden size.
            weights: ``[rows >= total_recv, topk]`` float32 rows to sum alongside, or None.
            indices: this rank's own ``[num_tokens, topk]`` int32 routing given to dispatch.
            use_external_inp_buf: -1 = config, 1 = push (copy ``input`` rows to the sources),
                0 = pull (sources read the registered buffer; zero-copy).
            call_reset: calls :meth:`reset` afterwards (a no-op kept for MORI).

        Returns:
            ``(out[max_num_inp_token_per_rank, hidden], out_weights[.., topk] f32 or None)``
            views of the op's buffers; rows ``[0, num_tokens)`` are valid.
        """
        if block_num != -1 or rdma_block_num != -1 or warp_per_block != -1:
            check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        n = self._dispatch_tokens
        if n is None:
            raise RuntimeError("combine() needs a preceding dispatch()")
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
                and tensor_matches(indices, torch.int32, (n, topk), dev)
                and (
                    not has_weights
                    or (
                        weights.dtype is torch.float32
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
        p = self._launches.get("combine_push" if push else "combine_pull", n, block_num, warp_per_block)
        self._cached_combine_launch = p
        try:
            self._launch_combine(
                self._handle_addr,
                input.data_ptr(),
                rows.dtype_code,
                rows.view.shape[1],
                in_rows,
                weights.data_ptr() if has_weights else 0,
                int(weights.shape[0]) if has_weights else 0,
                indices.data_ptr(),
                n,
                push,
                p.block_num,
                p.warp_per_block,
                self._stream_of(dev),
            )
        except self._failure as e:
            raise EpOpError(str(e)) from None
        return rows.view, (self._combine_out_weights if has_weights else None)

    def _validate_combine(
        self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor, num_tokens: int
    ) -> tuple[RowBuffer, bool]:
        """Full combine validation (raises with the argument and the limit); on success returns the
        output view for the input's (dtype, hidden), built on first use, and whether weights combine."""
        has_weights = check_combine_args(
            self.config, input, weights, indices, num_tokens, device=self.device, allowed_dtypes=COMBINE_DTYPES
        )
        h = int(input.shape[1])
        row_bytes = h * input.element_size()
        if row_bytes % 16:
            raise ValueError(f"input rows must be a multiple of 16 bytes, got hidden {h} x {input.element_size()} B")
        key = (input.dtype, h)
        rows = self._combine_rows.get(key)
        if rows is None:
            view = typed_view(self._bufs["combine_out"], input.dtype, self.config.max_num_inp_token_per_rank, h)
            rows = self._combine_rows[key] = RowBuffer(view, row_bytes, _COMBINE_DTYPE_CODE[input.dtype])
        return rows, has_weights

    def combine_send(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        warp_per_block: int = -1,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Same as :meth:`combine` with the config's combine mode."""
        return self.combine(input, weights, indices, block_num=block_num, warp_per_block=warp_per_block)

    def combine_recv(self, block_num: int = -1, warp_per_block: int = -1) -> None:
        """Nothing left to do after :meth:`combine_send` for IntraNode; returns None."""
        return None

    # ------------------------------------------------------------------ misc
    def get_dispatch_src_token_pos(self) -> torch.Tensor:
        """Synchronise and return int32 ``[total_recv]``: ``src_rank * max_num_tokens_to_send() +
        src_token`` for every received row (MORI's flat index; decode with
        :meth:`decode_send_flat_idx`)."""
        self.check_error(synchronize=True)
        n = int(self._total_recv.item())
        return self._src_pos[:n].clone()

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

    def close(self) -> None:
        """Return the op's symmetric buffers to the heap (collective: call on every rank)."""
        handle = getattr(self, "_handle", None)
        if handle is not None:
            torch.cuda.synchronize(self.device)
            self._bufs = {}
            self._handle_addr = 0
            handle.close()
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
