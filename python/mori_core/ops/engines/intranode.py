"""IntraNode engine: MORI-EP kernels over CUDA-IPC symmetric memory (``mori_core._C``).

Serves the ``IntraNode`` and ``IntraNodeLL`` kernel types (the LL type runs the same kernels:
they are already latency-oriented on NVLink). The compiled handle owns the buffers and the
checked launches; this engine allocates it, names its buffers and launches its kernels through
the handle's plain-int fast calls (see ``mori_core/csrc/bindings/ops_fast_calls.cpp``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mori_core.ops.call_cache import RowBuffer, stream_handle_getter
from mori_core.ops.combine_quant import combine_quant_code
from mori_core.ops.config import IMPLEMENTED_KERNEL_TYPES, EpDispatchCombineConfig, normalize_kernel_type
from mori_core.ops.engines.gpu_common import HandleEngine, byte_view, handle_fields, require_gpu_ops
from mori_core.ops.launch_config import (
    COMBINE_MODES,
    LaunchParams,
    checked_grid,
    combine_algorithm_override,
    combine_mode,
    combine_table_kernel,
    launch_mode,
    resolve,
)
from mori_core.ops.profiler import PROFILER_BUILD_HINT


_PUSH = COMBINE_MODES["push"]


class IntraNodeEngine(HandleEngine):
    """The IntraNode kernels of one op (construction is collective: same order on every rank)."""

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        kt = normalize_kernel_type(config.kernel_type)
        if kt not in IMPLEMENTED_KERNEL_TYPES:
            raise NotImplementedError(
                f"kernel_type {kt.name} is not implemented by mori_core; this build provides IntraNode "
                "(and IntraNodeLL, which runs the IntraNode kernels) for EP within one node"
            )
        combine_quant = combine_quant_code(config)  # FP8 transport of combine rows (combine_quant.py)
        self._combine_algo = combine_algorithm_override()  # MORI_EP_COMBINE_ALGO, read once per op
        self._quant = combine_quant
        require_gpu_ops()
        from mori_core import _C
        from mori_core import shmem

        self._place(config)
        self._handle = _C.EpDispatchCombineHandle(**handle_fields(config))
        self.handle = self._handle
        # Every rank must have placed the op's buffers at the same heap offset, and all ranks
        # must have zeroed them before any peer writes: one collective check does both.
        shmem.verify_symmetric("ep_op_offset", self._handle.heap_offset())
        self._handle.set_combine_quant(combine_quant)
        self._bind_buffers()
        self.launch_config_mode = launch_mode()
        self.failure = _C.EpOpFailure
        # Bound once for the launches (the op's hot path): the native fast calls, the handle's
        # address (0 once closed: the fast calls refuse it), the raw stream accessor.
        self._addr = int(self._handle.address)
        self._dev = self.device.index
        self._dispatch_native = _C.ep_launch_dispatch
        self._combine_native = _C.ep_launch_combine
        self._stream_of = stream_handle_getter()
        self._grid = (config.block_num, config.warp_num_per_block, int(self._handle.sm_count),
                      int(self._handle.arch_major), self.launch_config_mode, config.world_size)
        # A pull call that runs the push kernel reads the rows from the registered buffer.
        self._registered_rows = (self._views["combine_input"].data_ptr(), config.max_num_tokens_to_recv())
        from mori_core.ops.engines.intranode_standard_moe import IntraNodeStandardMoe

        self.standard_moe = IntraNodeStandardMoe(self._handle, config, self.device, self.failure)

    # ------------------------------------------------------------------ launches
    def resolve_launch(
        self, kernel: str, num_tokens: int, block_num: int, rdma_block_num: int, warp_per_block: int
    ) -> LaunchParams:
        """Per-call overrides > AUTO table > config (``launch_config.resolve``); rdma_block_num is unused.

        Combines (``combine_push`` / ``combine_pull``: the caller's mode) also get the kernel that
        runs them (``launch_config.combine_mode``) and the grid of that kernel's table."""
        cb, cw, sms, arch, mode, world = self._grid
        if kernel in ("combine_push", "combine_pull"):
            cmode = combine_mode(kernel == "combine_push", self._quant, self._combine_algo)
            p = checked_grid(resolve(combine_table_kernel(cmode), num_tokens, block_num, warp_per_block, cb, cw, sms,
                                     arch, mode, world))
            return LaunchParams(p.block_num, p.warp_per_block, cmode)
        return checked_grid(resolve(kernel, num_tokens, block_num, warp_per_block, cb, cw, sms, arch, mode, world))

    def launch_dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                        indices: torch.Tensor, num_tokens: int, row_bytes: int, plan: LaunchParams, finish: bool
                        ) -> None:
        """One kernel completes the exchange (``finish`` is always implied). An empty weights tensor
        is passed as the placeholder address (see :meth:`HandleEngine._bind_buffers`)."""
        self._dispatch_native(self._addr, input.data_ptr(), row_bytes, num_tokens,
                              0 if weights is None else (weights.data_ptr() or self._placeholder),
                              0 if scales is None else scales.data_ptr(), indices.data_ptr(), plan.block_num,
                              plan.warp_per_block, self._stream_of(self._dev))

    def launch_combine(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor,
                       num_tokens: int, rows: RowBuffer, input_rows: int, push: bool, plan: LaunchParams, finish: bool
                       ) -> None:
        """One kernel completes the exchange: ``plan.mode``'s (see :meth:`resolve_launch`). Rows or
        weights that lie in this rank's dispatch outputs are staged by the kernel first (the handle
        compares the addresses)."""
        mode = plan.mode if plan.mode >= 0 else int(push)
        ptr = input.data_ptr()
        if mode == _PUSH and not push:  # a pull call on the push kernel: the registered rows
            ptr, input_rows = self._registered_rows
        self._combine_native(self._addr, ptr, rows.dtype_code, rows.view.shape[1], input_rows,
                             0 if weights is None else weights.data_ptr(),
                             0 if weights is None else int(weights.shape[0]), indices.data_ptr(), num_tokens, mode,
                             plan.block_num, plan.warp_per_block, self._stream_of(self._dev))

    # ------------------------------------------------------------------ profiler and teardown
    def debug_time_buf(self) -> torch.Tensor:
        ptr, nbytes = self._handle.debug_time_buf()
        if not ptr:
            raise RuntimeError(PROFILER_BUILD_HINT)
        return byte_view(ptr, nbytes, self.device).view(torch.int64)

    def reset_debug_time_buf(self) -> None:
        self._handle.reset_debug_time_buf()

    def close(self) -> None:
        handle: Any = getattr(self, "_handle", None)
        if handle is not None:
            torch.cuda.synchronize(self.device)
            self._views = {}
            self._addr = 0
            handle.close()
            self._handle = self.handle = None
            self.standard_moe = None
