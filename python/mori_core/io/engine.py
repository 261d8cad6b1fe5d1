"""Typed Python wrappers of the IO engine (names and argument order of MORI)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from mori_core import _C
from mori_core._C import (
    BackendConfig,
    BackendType,
    EngineDesc,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TransferStatus,
)

if TYPE_CHECKING:  # torch is optional for the IO engine
    import torch

__all__ = ["IOEngine", "IOEngineSession", "Offsets"]

#: Offsets and sizes of a batch: a list or tuple of ints, or a 1-D integer
#: numpy array (any C-contiguous buffer of integers). Arrays are read in one
#: pass without a Python object per element: the cheapest form for big batches.
Offsets = Union[Sequence[int], Any]


def _check_nonneg(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")


class IOEngineSession:
    """A pre-resolved (local region, remote region) pair bound to one backend.

    Transfers through a session skip every route and cache lookup. Create one
    with :meth:`IOEngine.create_session`.
    """

    def __init__(self, engine: "IOEngine", native: "_C.IOEngineSession") -> None:
        self._engine = engine  # keeps the engine alive as long as the session
        self._native = native

    def allocate_transfer_uid(self) -> int:
        """A fresh transfer id (unique within the owning engine)."""
        return self._native.allocate_transfer_uid()

    def read(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        """Copy ``size`` bytes from the remote region into the local one."""
        try:
            return self._native.read(local_offset, remote_offset, size, transfer_uid)
        except TypeError:
            _check_nonneg(local_offset=local_offset, remote_offset=remote_offset, size=size, transfer_uid=transfer_uid)
            raise

    def write(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        """Copy ``size`` bytes from the local region into the remote one."""
        try:
            return self._native.write(local_offset, remote_offset, size, transfer_uid)
        except TypeError:
            _check_nonneg(local_offset=local_offset, remote_offset=remote_offset, size=size, transfer_uid=transfer_uid)
            raise

    def batch_read(
        self, local_offsets: Offsets, remote_offsets: Offsets, sizes: Offsets, transfer_uid: int
    ) -> TransferStatus:
        """Read many segments as one transfer (one status for the whole batch).

        The three arguments may be lists of ints or 1-D integer numpy arrays.
        A negative or non-integer entry raises TypeError naming it; segments
        outside a region end the status in ERR_INVALID_ARGS before anything moves.
        """
        try:
            return self._native.batch_read(local_offsets, remote_offsets, sizes, transfer_uid)
        except TypeError:
            _check_nonneg(transfer_uid=transfer_uid)
            raise

    def batch_write(
        self, local_offsets: Offsets, remote_offsets: Offsets, sizes: Offsets, transfer_uid: int
    ) -> TransferStatus:
        """Write many segments as one transfer (one status for the whole batch).

        Same argument rules as :meth:`batch_read`.
        """
        try:
            return self._native.batch_write(local_offsets, remote_offsets, sizes, transfer_uid)
        except TypeError:
            _check_nonneg(transfer_uid=transfer_uid)
            raise

    def alive(self) -> bool:
        """False once the session's backend link was closed for good."""
        return self._native.alive()


class IOEngine:
    """MORI-IO transfer engine.

    Args:
        key: unique name of this engine among the engines that talk to it.
        config: where the control-plane listener binds (``port=0`` = ephemeral;
            read the bound port from :meth:`get_engine_desc` after
            :meth:`create_backend`).
    """

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError("IOEngine: key must be a non-empty str")
        if not isinstance(config, IOEngineConfig):
            raise TypeError(f"IOEngine: config must be an IOEngineConfig, got {type(config).__name__}")
        self._native = _C.IOEngine(key, config)
        self.key = key

    # ----------------------------------------------------------- topology
    def get_engine_desc(self) -> EngineDesc:
        """This engine's descriptor; ``pack()`` it and hand it to peers."""
        return self._native.get_engine_desc()

    def create_backend(self, type: BackendType, config: Optional[BackendConfig] = None) -> None:
        """Add a transport. ``config`` defaults to the type's default config.

        Creating a network backend (TCP, RDMA) starts the engine's listener.
        Creating a backend that already exists logs a warning and does nothing.
        """
        if not isinstance(type, BackendType):
            raise TypeError(f"create_backend: type must be a BackendType, got {type!r}")
        self._native.create_backend(type, config)

    def remove_backend(self, type: BackendType) -> None:
        """Remove a transport; later transfers route to the remaining ones."""
        self._native.remove_backend(type)

    def backends(self) -> list[BackendType]:
        """The transports this engine has."""
        return list(self._native.backends())

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        """Make a peer known (no network I/O happens here)."""
        if not isinstance(engine_desc, EngineDesc):
            raise TypeError("register_remote_engine: engine_desc must be an EngineDesc (use EngineDesc.unpack)")
        self._native.register_remote_engine(engine_desc)

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        """Forget a peer and close the links to it (pending transfers fail)."""
        self._native.deregister_remote_engine(engine_desc)

    # -------------------------------------------------------------- memory
    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType) -> MemoryDesc:
        """Register ``size`` bytes at ``ptr`` for transfers.

        ``device_id`` is the GPU ordinal for ``MemoryLocationType.GPU`` and
        ignored (-1) for CPU memory. A peer can touch only registered bytes.
        """
        _check_nonneg(ptr=ptr, size=size)
        return self._native.register_memory(ptr, size, device_id, mem_loc)

    def register_torch_tensor(self, tensor: "torch.Tensor") -> MemoryDesc:
        """Register a contiguous CPU or CUDA tensor's storage bytes."""
        if not tensor.is_contiguous():
            raise ValueError("register_torch_tensor: tensor must be contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("register_torch_tensor: tensor is empty")
        if tensor.device.type == "cuda":
            return self._native.register_memory(tensor.data_ptr(), nbytes, tensor.device.index, MemoryLocationType.GPU)
        if tensor.device.type == "cpu":
            return self._native.register_memory(tensor.data_ptr(), nbytes, -1, MemoryLocationType.CPU)
        raise ValueError(f"register_torch_tensor: unsupported device {tensor.device}")

    def deregister_memory(self, mem_desc: MemoryDesc) -> None:
        """Stop serving a region; waits for transfers that use it to finish."""
        self._native.deregister_memory(mem_desc)

    # ----------------------------------------------------------- transfers
    def allocate_transfer_uid(self) -> int:
        """A fresh transfer id; tell the target out of band to poll notifications."""
        return self._native.allocate_transfer_uid()

    def read(
        self,
        local_dest_mem_desc: MemoryDesc,
        local_offset: int,
        remote_src_mem_desc: MemoryDesc,
        remote_offset: int,
        size: int,
        transfer_uid: int,
    ) -> TransferStatus:
        """One-sided read: remote bytes -> local memory."""
        try:
            return self._native.read(
                local_dest_mem_desc, local_offset, remote_src_mem_desc, remote_offset, size, transfer_uid
            )
        except TypeError:
            _check_nonneg(local_offset=local_offset, remote_offset=remote_offset, size=size, transfer_uid=transfer_uid)
            raise

    def write(
        self,
        local_src_mem_desc: MemoryDesc,
        local_offset: int,
        remote_dest_mem_desc: MemoryDesc,
        remote_offset: int,
        size: int,
        transfer_uid: int,
    ) -> TransferStatus:
        """One-sided write: local bytes -> remote memory."""
        try:
            return self._native.write(
                local_src_mem_desc, local_offset, remote_dest_mem_desc, remote_offset, size, transfer_uid
            )
        except TypeError:
            _check_nonneg(local_offset=local_offset, remote_offset=remote_offset, size=size, transfer_uid=transfer_uid)
            raise

    def batch_read(
        self,
        local_dest_mem_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Offsets],
        remote_src_mem_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Offsets],
        sizes: Sequence[Offsets],
        transfer_uids: Sequence[int],
    ) -> list[TransferStatus]:
        """Batched reads: one entry per (local, remote) pair, one status per pair.

        Every argument is checked before anything is submitted: outer lists of
        different lengths raise ValueError, bad entries TypeError naming them.
        """
        return self._batch(True, local_dest_mem_descs, local_offsets, remote_src_mem_descs, remote_offsets, sizes,
                           transfer_uids)

    def batch_write(
        self,
        local_src_mem_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Offsets],
        remote_dest_mem_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Offsets],
        sizes: Sequence[Offsets],
        transfer_uids: Sequence[int],
    ) -> list[TransferStatus]:
        """Batched writes: one entry per (local, remote) pair, one status per pair."""
        return self._batch(False, local_src_mem_descs, local_offsets, remote_dest_mem_descs, remote_offsets, sizes,
                           transfer_uids)

    def _batch(self, is_read, lm, lo, rm, ro, sz, uids) -> list[TransferStatus]:
        fn = self._native.batch_read if is_read else self._native.batch_write
        return fn(lm, lo, rm, ro, sz, uids)

    def create_session(self, local_mem_desc: MemoryDesc, remote_mem_desc: MemoryDesc) -> Optional[IOEngineSession]:
        """Bind a (local, remote) pair to its backend, or None if no backend can serve it."""
        native, _why = self._native.create_session(local_mem_desc, remote_mem_desc)
        return None if native is None else IOEngineSession(self, native)

    def route_of(self, local_mem_desc: MemoryDesc, remote_mem_desc: MemoryDesc) -> BackendType:
        """Which backend serves the pair (``BackendType.Unknown`` if none); raises nothing."""
        backend, _why = self._native.route_of(local_mem_desc, remote_mem_desc)
        return backend

    def explain_route(self, local_mem_desc: MemoryDesc, remote_mem_desc: MemoryDesc) -> str:
        """Human-readable reason why no backend serves the pair ("" when one does)."""
        return self._native.route_of(local_mem_desc, remote_mem_desc)[1]

    def pop_inbound_transfer_status(self, remote_key: str, transfer_uid: int) -> Optional[TransferStatus]:
        """Target side: a SUCCESS status once every part of ``(remote_key, transfer_uid)``
        has landed here, else None. Unlike AMD's MORI the entry is removed when
        reported, so each completed transfer is reported exactly once."""
        if self._native.pop_inbound_transfer_status(remote_key, transfer_uid):
            s = TransferStatus()
            s.Update(StatusCode.SUCCESS, "")
            return s
        return None

    def wait_all(self, statuses: Sequence[TransferStatus], timeout_ms: int = -1) -> StatusCode:
        """Wait for every status: SUCCESS, the first error, or IN_PROGRESS on timeout."""
        return _C.wait_all(list(statuses), timeout_ms)
