"""The connector's transfer pool: one registered tensor carved by a first-fit allocator.

The whole pool is registered with the IO engine once; payloads live in
aligned slices of it. :class:`PoolBuffer` has the duck type of vLLM-Omni's
``ManagedBuffer`` (``offset``, ``size``, ``pool_tensor``, ``tensor``,
``as_tensor``, ``to_bytes``, ``release``), which is what its KV-transfer
manager and callers of fast-path ``get`` rely on.
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from mori_core.io import IOEngine, MemoryDesc

__all__ = ["BufferAllocator", "PoolBuffer", "MemoryPool"]

logger = logging.getLogger(__name__)


class BufferAllocator:
    """First-fit allocator of aligned byte ranges in ``[0, total_size)`` (thread-safe).

    Free ranges are kept sorted and merged with their neighbours on free, so a
    pool that drains returns to a single free range.
    """

    def __init__(self, total_size: int, alignment: int = 4096) -> None:
        if total_size <= 0 or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"BufferAllocator: need total_size > 0 and a power-of-two alignment, "
                             f"got {total_size}, {alignment}")
        self.total_size = total_size
        self.alignment = alignment
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, total_size)]  # sorted (offset, size)
        self._used: dict[int, int] = {}  # offset -> aligned size

    def _aligned(self, size: int) -> int:
        return (size + self.alignment - 1) // self.alignment * self.alignment

    def alloc(self, size: int) -> int:
        """Reserve ``size`` bytes; returns the offset. Raises MemoryError when full."""
        if size <= 0:
            raise ValueError(f"BufferAllocator.alloc: size must be > 0, got {size}")
        need = self._aligned(size)
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, length - need)
                    self._used[start] = need
                    return start
            free_bytes = sum(length for _, length in self._free)
            largest = max((length for _, length in self._free), default=0)
        raise MemoryError(
            f"transfer pool exhausted: need {need} bytes, {free_bytes} free of {self.total_size} "
            f"(largest free range {largest}); raise memory_pool_size or consume payloads sooner"
        )

    def free(self, offset: int) -> None:
        """Return the range that starts at ``offset``. Raises ValueError if not allocated."""
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                raise ValueError(f"BufferAllocator.free: offset {offset} is not allocated (double free?)")
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # Merge with the right neighbour, then the left one.
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]

    @property
    def used_bytes(self) -> int:
        """Bytes currently allocated (aligned sizes)."""
        with self._lock:
            return sum(self._used.values())

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        """A copy of the sorted free list (offset, size)."""
        with self._lock:
            return list(self._free)


class PoolBuffer:
    """``size`` bytes at ``offset`` of a pool; release it when done (idempotent).

    A buffer published zero-copy (``put`` of the connector's own buffer) is *held* by the
    outbox until the payload is consumed, withdrawn or its TTL expires: a :meth:`release`
    meanwhile ends the caller's use at once (its views raise) but gives the bytes back to the
    pool only when the last hold ends, so no later allocation can overwrite what a receiver
    is about to pull.
    """

    def __init__(self, pool: "MemoryPool", offset: int, size: int) -> None:
        self.pool = pool
        self.offset = offset
        self.size = size
        self._released = False  # the owner is done with it
        self._freed = False  # the bytes went back to the pool (or were quarantined)
        self._holds = 0
        self._lock = threading.Lock()

    @property
    def pool_tensor(self) -> torch.Tensor:
        """The whole pool tensor (uint8)."""
        return self.pool.tensor

    @property
    def tensor(self) -> torch.Tensor:
        """A zero-copy 1-D uint8 view of the payload bytes."""
        if self._released:
            raise RuntimeError("PoolBuffer: the buffer was released")
        return self.pool.tensor[self.offset : self.offset + self.size]

    @property
    def released(self) -> bool:
        """True once :meth:`release` (or :meth:`leak`) was called."""
        return self._released

    @property
    def held(self) -> bool:
        """True while a published payload still needs these bytes (see the class docstring)."""
        return self._holds > 0

    def hold(self) -> None:
        """Keep the bytes out of the pool until :meth:`unhold`, even across :meth:`release`.

        Raises:
            RuntimeError: the buffer was already released (its bytes may be reused already).
        """
        with self._lock:
            if self._released:
                raise RuntimeError(f"{self!r} was released; a released buffer cannot be published")
            self._holds += 1

    def unhold(self) -> None:
        """End one :meth:`hold`; the bytes go back to the pool if the owner released them meanwhile."""
        with self._lock:
            if self._holds <= 0:
                raise RuntimeError(f"{self!r}: unhold() without hold()")
            self._holds -= 1
            free = self._holds == 0 and self._released and not self._freed
            self._freed = self._freed or free
        if free:
            self.pool.allocator.free(self.offset)

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy typed view; the byte count of ``dtype``×``shape`` must equal ``size``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for dim in shape:
            if dim < 0:
                raise ValueError(f"PoolBuffer.as_tensor: dimensions must be >= 0, got {shape}")
            numel *= dim
        if numel * itemsize != self.size:
            raise ValueError(f"PoolBuffer.as_tensor: {shape} x {dtype} is {numel * itemsize} bytes, "
                             f"the buffer holds {self.size}")
        return self.tensor.view(dtype).reshape(shape)

    def to_bytes(self) -> bytes:
        """A host copy of the payload bytes."""
        t = self.tensor
        if t.device.type != "cpu":
            t = t.cpu()
        return t.numpy().tobytes()

    def release(self) -> None:
        """Give the bytes back to the pool (no-op after the first call); deferred while held."""
        with self._lock:
            if self._released:
                return
            self._released = True
            free = self._holds == 0
            self._freed = free
        if free:
            self.pool.allocator.free(self.offset)

    def leak(self) -> None:
        """Never give the bytes back: a remote write into them may still land."""
        with self._lock:
            if self._released:
                return
            self._released = self._freed = True
        self.pool.note_leak(self.size)

    def __enter__(self) -> "PoolBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown or a closed pool: nothing left to protect
            pass

    def __repr__(self) -> str:
        return f"PoolBuffer(offset={self.offset}, size={self.size}, device={self.pool.device})"


class MemoryPool:
    """A pinned-CPU or CUDA byte tensor registered with an IO engine.

    Args:
        size: bytes.
        device: ``"cpu"`` (pinned when CUDA is available, pageable otherwise —
            the TCP backend reads either) or ``"cuda"``/``"cuda:N"``.
        alignment: allocation granularity.
    """

    def __init__(self, size: int, device: str, alignment: int = 4096) -> None:
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError(f"memory_pool_device {device!r} needs CUDA, but torch "
                                   f"{torch.__version__} sees no CUDA device")
            dev = torch.device(device)
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            self.tensor = torch.empty(size, dtype=torch.uint8, device=dev)
        else:
            self.tensor = torch.empty(size, dtype=torch.uint8)
            if torch.cuda.is_available():
                self.tensor = self.tensor.pin_memory()  # faster host<->device staging
        self.device = self.tensor.device
        self.size = size
        self.allocator = BufferAllocator(size, alignment)
        self.desc: Optional["MemoryDesc"] = None
        self.desc_packed = b""
        self._leaked = 0
        self._leak_lock = threading.Lock()

    @property
    def is_cuda(self) -> bool:
        """True for a GPU pool."""
        return self.device.type == "cuda"

    def register(self, engine: "IOEngine") -> None:
        """Register the whole pool with ``engine`` (once)."""
        self.desc = engine.register_torch_tensor(self.tensor)
        self.desc_packed = self.desc.pack()

    def deregister(self, engine: "IOEngine") -> None:
        """Undo :meth:`register` (idempotent)."""
        if self.desc is not None:
            desc, self.desc = self.desc, None
            engine.deregister_memory(desc)

    def alloc(self, size: int) -> PoolBuffer:
        """A buffer of ``size`` bytes; MemoryError when the pool is full."""
        return PoolBuffer(self, self.allocator.alloc(size), size)

    def owns(self, buf: Any) -> bool:
        """True when ``buf`` is a live buffer of this very pool."""
        return isinstance(buf, PoolBuffer) and buf.pool is self and not buf.released

    def note_leak(self, nbytes: int) -> None:
        """Account bytes that are deliberately never reused."""
        with self._leak_lock:
            self._leaked += nbytes
        logger.error("transfer pool: %d bytes quarantined for good (a remote write may still land there)", nbytes)

    def stats(self) -> dict[str, int]:
        """``pool_size``, ``pool_used_bytes`` and ``pool_leaked_bytes``."""
        return {"pool_size": self.size, "pool_used_bytes": self.allocator.used_bytes,
                "pool_leaked_bytes": self._leaked}
