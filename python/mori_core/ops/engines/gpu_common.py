"""What the two GPU engines share: build/device availability, the kernel timeout from the
environment, torch views of raw device memory, and the handle-backed engine base."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from mori_core.ops.config import EpDispatchCombineConfig
from mori_core.ops.engines.base import EpEngine

TIMEOUT_ENV = "MORI_EP_TIMEOUT_MS"
DEFAULT_TIMEOUT_MS = 10_000


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


def require_gpu_ops() -> None:
    """Raise RuntimeError naming what is missing when the GPU EP kernels cannot run here."""
    ok, why = gpu_ops_available()
    if not ok:
        raise RuntimeError(f"EpDispatchCombineOp needs the GPU build: {why}")


def handle_fields(config: EpDispatchCombineConfig) -> dict[str, int]:
    """The native handles' config fields (``EpOpConfig`` in ops/ep_handle_base.hpp) of ``config``,
    with the kernel timeout from the environment."""
    return dict(
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
        timeout_ms=timeout_ms_from_env(),
    )


def timeout_ms_from_env() -> int:
    """Bound of every kernel spin-wait: ``MORI_EP_TIMEOUT_MS`` (default 10 s); must be positive."""
    timeout_ms = int(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_MS))
    if timeout_ms <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of milliseconds, got {timeout_ms}")
    return timeout_ms


class _CudaBuffer:
    """Exposes raw device memory through __cuda_array_interface__ so torch can view it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def byte_view(ptr: int, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
    """uint8 tensor over ``nbytes`` of device memory at ``ptr`` (None for an empty buffer)."""
    if ptr == 0 or nbytes == 0:
        return None
    return torch.as_tensor(_CudaBuffer(ptr, nbytes), device=device)


def byte_views(buffers: dict, device: torch.device) -> dict[str, Optional[torch.Tensor]]:
    """``{name: byte_view}`` of a native handle's ``{name: (ptr, bytes)}`` table."""
    return {name: byte_view(ptr, size, device) for name, (ptr, size) in buffers.items()}


class HandleEngine(EpEngine):
    """What the IntraNode and inter-node engines share around their native handle: the named
    buffer views, the error record, the received-row positions and the kernel timeout.

    Subclasses set ``_handle`` (the native handle) in their constructor, then call
    :meth:`_bind_buffers`."""

    row_align = 16
    fast_accept = True
    _handle: Any = None
    _views: dict[str, Optional[torch.Tensor]] = {}
    _placeholder: int = 0

    def _bind_buffers(self) -> None:
        """``_views`` of the handle's buffers, and ``_placeholder``: the address to pass for a given
        but empty weights or scales tensor. An empty tensor (a rank with no tokens, or no received
        rows) has address 0, but the kernels read the address as "this round carries weights /
        scales" (an inter-node receiver with no tokens of its own dropped the scales of every row it
        received; standard-MoE receivers weight rows by it). A valid buffer stands in; it is never
        read through, since the rows to copy from it number zero."""
        self._views = byte_views(self._handle.buffers(), self.device)
        self._placeholder = self._views["dispatch_out_weights"].data_ptr()

    def _place(self, config: EpDispatchCombineConfig) -> None:
        """Start of both constructors: shmem must be initialised with this rank and world size,
        and the engine lives on shmem's device."""
        from mori_core import shmem

        shmem.require_initialized(config.rank, config.world_size)
        self.config = config
        self.device = self.arg_device = torch.device("cuda", shmem.shmem_device())

    def buffer_views(self) -> dict[str, Optional[torch.Tensor]]:
        return self._views

    def src_token_pos(self) -> torch.Tensor:
        n = int(self._views["total_recv"].view(torch.int32)[0].item())
        return self._views["src_pos"].view(torch.int32)[:n].clone()

    def error_message(self) -> str:
        return self._handle.error_message()

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    @property
    def timeout_ms(self) -> int:
        return int(self._handle.timeout_ms)

    @timeout_ms.setter
    def timeout_ms(self, value: int) -> None:
        self._handle.timeout_ms = int(value)
