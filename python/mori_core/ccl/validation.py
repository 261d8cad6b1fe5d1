"""Argument checks of the MORI-CCL calls, shared by the GPU engines and the CPU reference, so
both refuse the same input with the same message (naming the argument and the limit) before
anything is enqueued: a refused call changes nothing and the handle stays usable."""

from __future__ import annotations

from typing import Any, Optional

import torch

KINDS = ("allgather", "all2all", "allreduce")


def element_counts(kind: str, npes: int, count: int) -> tuple[int, int]:
    """Elements of (input, output) one call with ``count`` reads and writes."""
    if kind == "allgather":
        return count, npes * count
    if kind == "all2all":
        return npes * count, npes * count
    return count, count


def check_count(count: Any) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")
    return count


def _device_code(device: torch.device) -> int:
    """What ``Tensor.get_device()`` returns for a tensor on ``device`` (-1: CPU)."""
    return -1 if device.type == "cpu" else (device.index if device.index is not None else 0)


def check_tensors(
    kind: str,
    npes: int,
    rank: int,
    inp: Any,
    out: Any,
    count: int,
    device: torch.device,
    dtype: Optional[torch.dtype],
    input_limit: int,
    output_limit: int,
    out_name: str = "output_data",
) -> int:
    """Check one call; returns the byte count the native handle takes (all-gather: input
    bytes per rank; all-to-all: bytes of one peer's chunk; all-reduce: input bytes).

    ``dtype``: the all-reduce handle's dtype (None: any dtype moves as bytes).
    ``input_limit`` / ``output_limit``: the handle's input_buffer_size / output_buffer_size.

    Runs on every call, so the common case costs a few integer comparisons (the per-call host
    time is part of the small collectives' latency); the messages are built only on failure."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")
    if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor):
        name, t = ("input_data", inp) if not isinstance(inp, torch.Tensor) else (out_name, out)
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dev = _device_code(device)
    if (dev >= 0 and not (inp.is_cuda and out.is_cuda and inp.get_device() == dev and out.get_device() == dev)) or (
            dev < 0 and not (inp.is_cpu and out.is_cpu)):  # get_device() is -1 for CPU and meta alike
        name, t = ("input_data", inp) if inp.device != device else (out_name, out)
        raise ValueError(f"{name} is on {t.device}; this handle's rank {rank} works on {device}")
    if not inp.is_contiguous():
        raise ValueError("input_data must be contiguous")
    if not out.is_contiguous():
        raise ValueError(f"{out_name} must be contiguous")
    in_dtype = inp.dtype
    if dtype is not None and in_dtype != dtype:
        raise ValueError(f"input_data has dtype {in_dtype}; this handle was built for dtype={dtype}")
    if out.dtype != in_dtype:
        raise ValueError(f"{out_name} has dtype {out.dtype}, input_data {in_dtype}; they must match")
    n_in, n_out = element_counts(kind, npes, count)
    if inp.numel() < n_in:
        raise ValueError(f"count={count} needs {n_in} elements of input_data, it has {inp.numel()}")
    if out.numel() < n_out:
        raise ValueError(f"count={count} needs {n_out} elements of {out_name}, it has {out.numel()}")
    esize = inp.element_size()
    if n_in * esize > input_limit:
        raise ValueError(
            f"count={count} is {n_in * esize} bytes of input per rank, more than input_buffer_size={input_limit}"
        )
    if n_out * esize > output_limit:
        raise ValueError(
            f"count={count} is {n_out * esize} bytes of output per rank, more than output_buffer_size={output_limit}"
        )
    if count:
        _check_overlap(kind, rank, count, inp, out, n_in, n_out, out_name)
    return count * esize  # all-gather: per rank; all-to-all: per peer chunk; all-reduce: the whole input


def _check_overlap(kind: str, rank: int, count: int, inp: torch.Tensor, out: torch.Tensor, n_in: int, n_out: int,
                   out_name: str) -> None:
    esize = inp.element_size()
    a0, b0 = inp.data_ptr(), out.data_ptr()
    if a0 + n_in * esize <= b0 or b0 + n_out * esize <= a0:
        return
    if kind == "allreduce" and a0 == b0:
        return  # in place
    if kind == "allgather" and a0 == b0 + rank * count * esize:
        return  # in place: the input is this rank's chunk of the output
    raise ValueError(
        f"input_data and {out_name} overlap; "
        + {
            "allreduce": "an in-place all-reduce passes the same tensor (or use allreduce_inplace)",
            "allgather": "an in-place all-gather passes this rank's chunk of the output as input_data",
            "all2all": "an all-to-all needs separate input and output",
        }[kind]
    )
