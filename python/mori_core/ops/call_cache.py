"""What the GPU EP op prepares once and reuses on every call (the host's hot path).

A dispatch or combine call must cost a few microseconds of host time: eager callers (prefill,
every framework path that is not graph-captured) pay it on every MoE layer, and at small
batches it is larger than the kernel. So the op keeps, per (dtype, hidden size), the typed
views of its output buffers and the row size; per (kernel, tokens, overrides) the resolved
launch parameters (a dict in the op); and the engines read the current CUDA stream through
torch's raw-stream accessor instead of building a ``torch.cuda.Stream`` object. Validation stays complete: a fast
predicate accepts only arguments that the full validators in :mod:`validation` would accept,
and anything else goes through those validators, which raise with the argument and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

_raw_stream: Optional[Callable[[int], int]] = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle_getter() -> Callable[[int], int]:
    """The fastest available ``device_index -> current stream handle`` function (bound once by
    the op, so a call does not pay an extra Python frame)."""
    return _raw_stream if _raw_stream is not None else current_stream_handle


def current_stream_handle(device_index: int) -> int:
    """Handle (``cudaStream_t`` as int) of the current stream of ``device_index``.

    torch's raw accessor costs ~0.1 us; ``torch.cuda.current_stream()`` builds a Python
    stream object (microseconds), which is kept only as the fallback for torch builds
    without the accessor."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@dataclass(frozen=True)
class RowBuffer:
    """One output buffer seen as ``[rows, hidden]`` of one dtype (built once, reused)."""

    view: Optional[torch.Tensor]  # typed view of the engine's buffer (None: the engine returns fresh outputs)
    row_bytes: int  # hidden * element size
    dtype_code: int  # combine's dtype code for the kernels (-1 where unused)


def typed_view(buf: torch.Tensor, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` view of ``dtype`` over the first bytes of the byte buffer ``buf``."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return buf[: rows * cols * itemsize].view(dtype).view(rows, cols)

