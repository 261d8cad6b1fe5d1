"""``AllGatherIntoTensor``: upstream MORI's NCCL-style all-gather entry point (raw device
addresses, an element count and a :class:`DataType`), over the same engines as
:class:`~mori_core.ccl.collectives.AllgatherSdma`."""

from __future__ import annotations

import enum
from typing import Any, Optional, Union

import torch

from mori_core.ccl.collectives import AllgatherSdma
from mori_core.ccl.options import CclOptions
from mori_core.ccl.validation import check_count

__all__ = ["AllGatherIntoTensor", "DataType", "size_of"]


class DataType(enum.IntEnum):
    """Element types (upstream's ``mori.ccl.DataType``, same values)."""

    Int8 = 0
    Uint8 = 1
    Int16 = 2
    Uint16 = 3
    Int32 = 4
    Uint32 = 5
    Int64 = 6
    Uint64 = 7
    Float16 = 8
    BFloat16 = 9
    Float32 = 10
    Float64 = 11


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 8, 7: 8, 8: 2, 9: 2, 10: 4, 11: 8}


def size_of(dtype: Union[DataType, int]) -> int:
    """Bytes of one element of ``dtype``."""
    try:
        return _SIZES[int(dtype)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"dtype={dtype!r} is not a mori.ccl.DataType") from None


Buffer = Union[int, torch.Tensor]


class AllGatherIntoTensor:
    """``op(sendbuff, recvbuff, sendcount, dtype, stream)``: every rank's ``sendcount``
    elements of ``dtype`` at ``sendbuff`` land at ``recvbuff + rank * sendcount * size``.

    Buffers are device addresses (ints) as upstream takes them, or tensors. Unlike upstream,
    any byte count works (upstream needs a multiple of 4). ``auto_register`` is accepted and
    has nothing to do: the output is always written directly."""

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: Optional[int] = None,
        output_buffer_size: Optional[int] = None,
        copy_output_to_user: bool = True,
        auto_register: bool = False,
        transit_buffer_size: Optional[int] = None,
        *,
        engine: Optional[str] = None,
        options: Optional[CclOptions] = None,
    ) -> None:
        self._ag = AllgatherSdma(my_pe, npes, input_buffer_size, output_buffer_size, transit_buffer_size,
                                 copy_output_to_user, engine=engine, options=options)
        self.auto_register = bool(auto_register)

    def _views(self, sendbuff: Buffer, recvbuff: Buffer, sendcount: int, dtype: Union[DataType, int]) -> tuple:
        size = size_of(dtype)
        count = check_count(sendcount)
        nbytes = count * size

        def view(buf: Buffer, n: int, name: str) -> torch.Tensor:
            if isinstance(buf, torch.Tensor):
                return buf.reshape(-1).view(torch.uint8)[:n] if buf.is_contiguous() else buf
            if isinstance(buf, bool) or not isinstance(buf, int) or buf <= 0:
                raise ValueError(f"{name} must be a device address (int > 0) or a tensor, got {buf!r}")
            if self._ag.device.type != "cuda":
                raise ValueError(f"{name}: the CPU reference needs tensors, not addresses")
            from mori_core.ops.engines.gpu_common import byte_view

            return byte_view(buf, max(n, 1), self._ag.device)[:n]

        return view(sendbuff, nbytes, "sendbuff"), view(recvbuff, nbytes * self._ag.npes, "recvbuff"), nbytes

    def __call__(self, sendbuff: Buffer, recvbuff: Buffer, sendcount: int, dtype: Union[DataType, int],
                 stream: Any = None) -> bool:
        """All-gather on ``stream`` (an int handle, a torch stream, or None: the current
        stream). Returns True; errors raise."""
        send, recv, nbytes = self._views(sendbuff, recvbuff, sendcount, dtype)
        return self._ag(send, recv, nbytes, stream)

    def start_async(self, sendbuff: Buffer, recvbuff: Buffer, sendcount: int, dtype: Union[DataType, int],
                    stream: Any = None) -> bool:
        send, recv, nbytes = self._views(sendbuff, recvbuff, sendcount, dtype)
        return self._ag.start_async(send, recv, nbytes, stream)

    def wait_async(self, stream: Any = None) -> float:
        return self._ag.wait_async(stream)

    def is_async_in_progress(self) -> bool:
        return self._ag.is_async_in_progress()

    def cancel_async(self) -> None:
        self._ag.cancel_async()

    def register_output_buffer(self, ptr: Buffer, size: int = 0) -> None:
        self._ag._registered.add(ptr.data_ptr() if isinstance(ptr, torch.Tensor) else int(ptr))

    def deregister_output_buffer(self, ptr: Buffer) -> None:
        self._ag._registered.discard(ptr.data_ptr() if isinstance(ptr, torch.Tensor) else int(ptr))

    def is_output_registered(self, ptr: Buffer) -> bool:
        return (ptr.data_ptr() if isinstance(ptr, torch.Tensor) else int(ptr)) in self._ag._registered

    def resetFlags(self) -> None:  # noqa: N802 - upstream's C++ name
        self._ag.reset_flags()

    def reset_flags(self) -> None:
        self._ag.reset_flags()

    def check_error(self) -> None:
        self._ag.check_error()

    def my_pe(self) -> int:
        return self._ag.my_pe

    def npes(self) -> int:
        return self._ag.npes

    def close(self) -> None:
        self._ag.close()
