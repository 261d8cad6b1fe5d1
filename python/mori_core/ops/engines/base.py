"""The engine interface: what :class:`~mori_core.ops.EpDispatchCombineOp` needs from a kernel family.

The op (the "front door", :mod:`mori_core.ops.dispatch_combine`) owns the MORI API: argument
checks, the fast accept of the eager host path, launch-plan caching, split send/recv state,
output views, the standard-MoE entry points and error reporting. An engine only moves data:

* construction allocates its buffers (collective for the GPU engines) and fills the traits below;
* ``resolve_launch`` turns a call's launch overrides into the grid to launch (cached by the op);
* ``launch_dispatch`` / ``launch_combine`` start one exchange on validated arguments; a split-phase
  engine (AsyncLL) launches only the send half when ``finish`` is False and completes it in
  ``finish_dispatch`` / ``finish_combine``;
* ``buffer_views`` gives the byte buffers the op views as outputs. Engines that write into them
  return None from the launches; an engine without device buffers (reference) returns the
  outputs itself;
* ``error_message``, ``src_token_pos``, ``close`` and the optional profiler / standard-MoE parts.

The op reads every trait and binds every launch method once at construction, so a call costs
no lookup through the engine. Engines never import the op (no import cycle); the op imports an
engine module only when a config selects it.
"""

from __future__ import annotations

import abc
from typing import Any, Optional

import torch

from mori_core.ops.call_cache import RowBuffer
from mori_core.ops.launch_config import LaunchParams
from mori_core.ops.validation import COMBINE_DTYPES

DispatchOutputs = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]
CombineOutputs = tuple[torch.Tensor, Optional[torch.Tensor]]


class NoFailure(Exception):
    """Failure type of engines whose launches report failures as ordinary exceptions (never raised)."""


class EpEngine(abc.ABC):
    """One kernel family behind the op. Subclasses set the traits in their constructor."""

    #: where the engine's outputs live
    device: torch.device
    #: the native handle (exposed as ``op._handle`` for MORI's ``mori.cpp`` calls), or None
    handle: Any = None
    #: where dispatch/combine tensors must live; None accepts any one device (reference)
    arg_device: Optional[torch.device] = None
    #: row sizes must be a multiple of this many bytes (16: the kernels' vector copies)
    row_align: int = 1
    #: dtypes combine accumulates
    combine_dtypes: tuple = COMBINE_DTYPES
    #: the op may accept a call through its fast predicate (device engines with cached views)
    fast_accept: bool = False
    #: dispatch_send/combine_send launch only the send half (AsyncLL)
    split_phases: bool = False
    #: native exception a launch raises when an earlier kernel of the op failed (-> EpOpError)
    failure: type = NoFailure
    #: MORI_EP_LAUNCH_CONFIG_MODE seen at construction ("AUTO"/"MANUAL")
    launch_config_mode: str = "MANUAL"
    #: standard-MoE (3-D layout) part, or None when this family has none
    standard_moe: Any = None

    # ------------------------------------------------------------------ launches
    @abc.abstractmethod
    def resolve_launch(
        self, kernel: str, num_tokens: int, block_num: int, rdma_block_num: int, warp_per_block: int
    ) -> LaunchParams:
        """Grid of ``kernel`` ("dispatch", "combine_push", "combine_pull") for a call; raises ValueError
        when out of range. The answer must depend only on the arguments (the op caches it)."""

    @abc.abstractmethod
    def launch_dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                        indices: torch.Tensor, num_tokens: int, row_bytes: int, plan: LaunchParams, finish: bool
                        ) -> Optional[DispatchOutputs]:
        """Start a dispatch of validated tensors (``scales`` None when none travel)."""

    def finish_dispatch(self, plan: LaunchParams) -> None:
        """Complete a dispatch launched with ``finish=False`` (split-phase engines only)."""

    @abc.abstractmethod
    def launch_combine(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor,
                       num_tokens: int, rows: RowBuffer, input_rows: int, push: bool, plan: LaunchParams, finish: bool
                       ) -> Optional[CombineOutputs]:
        """Start a combine of validated tensors (``weights`` None when none are combined)."""

    def finish_combine(self, plan: LaunchParams) -> None:
        """Complete a combine launched with ``finish=False`` (split-phase engines only)."""

    # ------------------------------------------------------------------ buffers and state
    @abc.abstractmethod
    def buffer_views(self) -> dict[str, Optional[torch.Tensor]]:
        """Byte views of the engine's buffers by name (``dispatch_out``, ``combine_input``, ...)."""

    @abc.abstractmethod
    def src_token_pos(self) -> torch.Tensor:
        """int32 flat source index of every row received by the last dispatch (synchronised)."""

    def error_message(self) -> str:
        """"" while no kernel reported a failure, else its description."""
        return ""

    def synchronize(self) -> None:
        """Wait for the engine's work on the current stream (before reading error records)."""

    @property
    def timeout_ms(self) -> int:
        """Bound of every kernel spin-wait."""
        raise AttributeError(f"{type(self).__name__} has no kernel timeout")

    @timeout_ms.setter
    def timeout_ms(self, value: int) -> None:
        raise AttributeError(f"{type(self).__name__} has no kernel timeout")

    def debug_time_buf(self) -> torch.Tensor:
        """The kernel profiler's int64 event buffer."""
        raise NotImplementedError(f"the kernel profiler is not available for {type(self).__name__}")

    def reset_debug_time_buf(self) -> None:
        """Clear the profiler's events (no-op where there is none)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine's buffers (collective for the GPU engines). Idempotent."""
