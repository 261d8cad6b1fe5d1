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
    EpDispatchCombineConfig,
    decode_src_token_pos,
    normalize_kernel_type,
)
from mori_core.ops.combine_quant import combine_quant_code
from mori_core.ops.launch_config import LaunchParams, launch_mode, resolve
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


def _typed_view(buf: torch.Tensor, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return buf[: rows * cols * itemsize].view(dtype).view(rows, cols)


class EpDispatchCombineOp(StandardMoeMixin, ProfilerMixin):
    """IntraNode expert-parallel dispatch/combine on the GPUs of one node (MORI's API).

    Requires :func:`mori_core.shmem.shmem_torch_process_group_init` (or ``shmem_init_attr``)
    on every rank first, with ``config.rank``/``config.world_size`` equal to the shmem
    rank/size. Construction is collective: every rank must create its ops in the same order.
    """

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
        shmem.verify_symmetric(f"ep_op_offset", self._handle.heap_offset())
        self._handle.set_combine_quant(combine_quant)
        bufs = {name: _byte_view(ptr, size, self.device) for name, (ptr, size) in self._handle.buffers().items()}
        self._bufs = bufs
        self._max_recv = config.max_num_tokens_to_recv()
        self._total_recv = bufs["total_recv"].view(torch.int32)[:1]
        self._src_pos = bufs["src_pos"].view(torch.int32)
        self.local_expert_count = torch.zeros(config.num_experts_per_rank, dtype=torch.int32, device=self.device)
        self.launch_config_mode = launch_mode()
        self._sm_count = int(self._handle.sm_count)
        self._arch_major = int(self._handle.arch_major)
        self._dispatch_tokens: Optional[int] = None
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
        return int(self._handle.timeout_ms)

    @timeout_ms.setter
    def timeout_ms(self, value: int) -> None:
        if int(value) <= 0:
            raise ValueError(f"timeout_ms must be positive, got {value}")
        self._handle.timeout_ms = int(value)

    def get_launch_config(self, is_dispatch: bool = True, num_tokens: int = 0, zero_copy: bool = False) -> LaunchParams:
        """The (block_num, warp_per_block) a call without overrides would use."""
        kernel = "dispatch" if is_dispatch else ("combine_pull" if zero_copy else "combine_push")
        return self._launch(kernel, num_tokens, -1, -1)

    def _launch(self, kernel: str, num_tokens: int, block_num: int, warp_per_block: int) -> LaunchParams:
        p = resolve(
            kernel,
            num_tokens,
            block_num,
            warp_per_block,
            self.config.block_num,
            self.config.warp_num_per_block,
            self._sm_count,
            self._arch_major,
            self.launch_config_mode,
            self.config.world_size,
        )
        max_warps = 512 // 32
        if not 1 <= p.warp_per_block <= max_warps:
            raise ValueError(f"warp_per_block={p.warp_per_block} must be in [1, {max_warps}] (512 threads per block)")
        if p.block_num < 1:
            raise ValueError(f"block_num={p.block_num} must be >= 1")
        return p

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
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        cfg = self.config
        args = check_dispatch_args(cfg, input, weights, scales, indices, device=self.device, allowed_dtypes=DISPATCH_DTYPES)
        row_bytes = args.hidden_dim * input.element_size()
        if row_bytes % 16:
            raise ValueError(
                f"input rows must be a multiple of 16 bytes (hidden {args.hidden_dim} x {input.element_size()} B "
                f"= {row_bytes} B) for the 16-byte vector copies"
            )
        p = self._launch("dispatch", args.num_tokens, block_num, warp_per_block)
        self._cached_dispatch_launch = p
        self._handle.launch_dispatch(
            input.data_ptr(),
            row_bytes,
            args.num_tokens,
            weights.data_ptr() if args.has_weights else 0,
            scales.data_ptr() if args.has_scales else 0,
            indices.data_ptr(),
            p.block_num,
            p.warp_per_block,
            torch.cuda.current_stream(self.device).cuda_stream,
        )
        self._dispatch_tokens = args.num_tokens
        topk, mr = cfg.num_experts_per_token, self._max_recv
        out = _typed_view(self._bufs["dispatch_out"], input.dtype, mr, args.hidden_dim)
        out_weights = _typed_view(self._bufs["dispatch_out_weights"], torch.float32, mr, topk)
        out_indices = _typed_view(self._bufs["dispatch_out_indices"], torch.int32, mr, topk)
        out_scales = None
        if args.has_scales:
            out_scales = _typed_view(self._bufs["dispatch_out_scales"], scales.dtype, mr, cfg.scale_dim)
        if call_local_expert_count:
            self._count_local_experts(out_indices)
        return out, out_weights, out_scales, out_indices, self._total_recv

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
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        if self._dispatch_tokens is None:
            raise RuntimeError("combine() needs a preceding dispatch()")
        cfg = self.config
        has_weights = check_combine_args(
            cfg, input, weights, indices, self._dispatch_tokens, device=self.device, allowed_dtypes=COMBINE_DTYPES
        )
        push = resolve_combine_mode(cfg, use_external_inp_buf)
        h = int(input.shape[1])
        if (h * input.element_size()) % 16:
            raise ValueError(f"input rows must be a multiple of 16 bytes, got hidden {h} x {input.element_size()} B")
        n = self._dispatch_tokens
        p = self._launch("combine_push" if push else "combine_pull", n, block_num, warp_per_block)
        self._cached_combine_launch = p
        w_ptr = weights.data_ptr() if has_weights else 0
        w_symmetric = has_weights and w_ptr == self._bufs["dispatch_out_weights"].data_ptr()
        self._handle.launch_combine(
            input.data_ptr(),
            _COMBINE_DTYPE_CODE[input.dtype],
            h,
            int(input.shape[0]),
            w_ptr,
            int(weights.shape[0]) if has_weights else 0,
            bool(w_symmetric),
            indices.data_ptr(),
            n,
            bool(push),
            p.block_num,
            p.warp_per_block,
            torch.cuda.current_stream(self.device).cuda_stream,
        )
        out = _typed_view(self._bufs["combine_out"], input.dtype, cfg.max_num_inp_token_per_rank, h)
        out_weights = None
        if has_weights:
            out_weights = _typed_view(
                self._bufs["combine_out_weights"], torch.float32, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_token
            )
        if call_reset:
            self.reset()
        return out, out_weights

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
        if h > self.config.hidden_dim:
            raise ValueError(f"hidden_dim={h} exceeds config.hidden_dim={self.config.hidden_dim}")
        if dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dtype {dtype} is not supported; use one of {list(DISPATCH_DTYPES)}")
        if torch.empty(0, dtype=dtype).element_size() > self.config.max_token_type_size:
            raise ValueError(f"dtype {dtype} is wider than max_token_type_size={self.config.max_token_type_size}")
        return _typed_view(self._bufs["combine_input"], dtype, self._max_recv, h)

    def reset(self) -> None:
        """No-op kept for MORI compatibility: the kernels reset their counters themselves."""
        return None

    def close(self) -> None:
        """Return the op's symmetric buffers to the heap (collective: call on every rank)."""
        handle = getattr(self, "_handle", None)
        if handle is not None:
            torch.cuda.synchronize(self.device)
            self._bufs = {}
            handle.close()
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
