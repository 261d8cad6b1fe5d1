"""MORI-CCL's collective classes (``mori.ccl``): :class:`AllgatherSdma`, :class:`All2allSdma`
and :class:`AllreduceSdma`, with upstream MORI's constructor arguments and call signatures.

On a GPU build with shmem initialised they run on the symmetric heap with two engines, chosen
by size (``engine="auto"``) or forced (``engine="ce"`` copy engines: zero SMs move or wait;
``engine="sm"``: kernels); see :mod:`mori_core.ccl.options`. Without a GPU the same classes
run the CPU reference over the default torch.distributed group (:mod:`mori_core.ccl.reference`).

Every rank constructs the same collectives in the same order and makes the same calls (a
collective); calls of one handle run in order (the same stream, or synchronised streams).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from mori_core.ccl.gpu import GpuBackend, gpu_ccl_available, stream_handle
from mori_core.ccl.options import CclOptions
from mori_core.ccl.reference import ReferenceBackend
from mori_core.ccl.validation import check_tensors

DEFAULT_TRANSIT_BUFFER_SIZE = 512 << 20  # upstream's default, split evenly between input and output

__all__ = ["AllgatherSdma", "All2allSdma", "AllreduceSdma"]


def _open_backend(kind: str, my_pe: int, npes: int, input_bytes: int, dtype: Optional[torch.dtype],
                  opts: CclOptions) -> Any:
    if gpu_ccl_available():
        return GpuBackend(kind, my_pe, npes, input_bytes, dtype, opts)
    return ReferenceBackend(kind, my_pe, npes)


class _Collective:
    """What the three collectives share: buffers, engine choice, sync / async calls, errors."""

    _KIND = ""

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: Optional[int],
        output_buffer_size: Optional[int],
        transit_buffer_size: Optional[int],
        copy_output_to_user: bool,
        dtype: Optional[torch.dtype],
        engine: Optional[str],
        options: Optional[CclOptions],
    ) -> None:
        for name, v in (("my_pe", my_pe), ("npes", npes)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if not 1 <= npes <= 8:
            raise ValueError(f"npes={npes} must be in [1, 8] (one node)")
        if not 0 <= my_pe < npes:
            raise ValueError(f"my_pe={my_pe} must be in [0, npes={npes})")
        in_bytes, out_bytes = self._buffer_sizes(npes, input_buffer_size, output_buffer_size, transit_buffer_size)
        if options is not None and engine is not None:
            options = CclOptions.resolve(**{**options.__dict__, "engine": engine})
        self.options = options if options is not None else CclOptions.resolve(engine=engine)
        self.my_pe, self.npes = my_pe, npes
        self.dtype = dtype
        self.input_buffer_size, self.output_buffer_size = in_bytes, out_bytes
        self.copy_output_to_user = bool(copy_output_to_user)
        self.last_path = ""  # the engine path of the latest call ("sm", "ce", "sm-oneshot", ...)
        self._backend = _open_backend(self._KIND, my_pe, npes, in_bytes, dtype, self.options)
        self._gpu = isinstance(self._backend, GpuBackend)
        self.device = self._backend.device
        self._transit: Optional[torch.Tensor] = None
        if not self.copy_output_to_user:  # results stay in the output transit buffer (upstream's mode)
            self._transit = torch.empty((out_bytes + 15) // 16 * 16, dtype=torch.uint8, device=self.device)
        self._async_start: Optional[float] = None
        self._async_stream: Any = None

    def _buffer_sizes(self, npes: int, inp: Optional[int], out: Optional[int],
                      transit: Optional[int]) -> tuple[int, int]:
        for name, v in (("input_buffer_size", inp), ("output_buffer_size", out), ("transit_buffer_size", transit)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int (bytes), got {v!r}")
        grow = npes if self._KIND == "allgather" else 1
        if inp is not None and out is not None:
            return inp, out
        if inp is not None:  # output sized from the input
            return inp, inp * grow
        if out is not None:
            return out // grow, out
        total = transit if transit is not None else DEFAULT_TRANSIT_BUFFER_SIZE
        return total // 2, total // 2

    # ------------------------------------------------------------------ calls
    def _prepare(self, inp: torch.Tensor, out: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
        target, out_name = out, "output_data"
        if self._transit is not None:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"output_data must be a torch.Tensor, got {type(out).__name__}")
            target, out_name = self._transit_view(getattr(inp, "dtype", torch.uint8)), "the output transit buffer"
        nbytes = check_tensors(self._KIND, self.npes, self.my_pe, inp, target, count, self.device, self.dtype,
                               self.input_buffer_size, self.output_buffer_size, out_name)
        return target, nbytes

    def _run(self, inp: torch.Tensor, out: torch.Tensor, count: int, stream: Any) -> None:
        target, nbytes = self._prepare(inp, out, count)
        if self._gpu:
            code = self._backend.run(inp.data_ptr(), target.data_ptr(), nbytes, stream_handle(stream, self.device))
            self.last_path = self._backend.path_names[code]
        else:
            self._backend.run(inp, target, count)
            self.last_path = "reference"

    def start_async(self, input_data: torch.Tensor, output_data: torch.Tensor, count: int, stream: Any = None) -> bool:
        """Start the collective on ``stream`` (the sending half); finish it with
        :meth:`wait_async`. Compute enqueued in between overlaps with the transfer. Returns True."""
        if self._async_start is not None:
            raise RuntimeError("start_async is already in progress on this handle; call wait_async first")
        target, nbytes = self._prepare(input_data, output_data, count)
        if self._gpu:
            s = stream_handle(stream, self.device)
            code = self._backend.start(input_data.data_ptr(), target.data_ptr(), nbytes, s)
            self.last_path = self._backend.path_names[code]
            self._async_stream = s
        else:
            self._backend.start(input_data, target, count)
            self.last_path = "reference"
        self._async_start = time.perf_counter()
        return True

    def wait_async(self, stream: Any = None) -> float:
        """Finish the started collective on ``stream`` (default: the current stream; may differ
        from start_async's). Returns the host seconds since start_async (the GPU work stays
        asynchronous on ``stream``)."""
        if self._async_start is None:
            raise RuntimeError("wait_async without a start_async in progress")
        started, self._async_start = self._async_start, None
        if self._gpu:
            self._backend.finish(stream_handle(stream, self.device))
        else:
            self._backend.finish()
        return time.perf_counter() - started

    def is_async_in_progress(self) -> bool:
        """True between start_async and wait_async."""
        return self._async_start is not None

    def cancel_async(self) -> None:
        """End a started collective. Work already on the GPU cannot be withdrawn: this finishes
        it on start_async's stream and clears the async state (the output is then valid too)."""
        if self._async_start is None:
            return
        self._async_start = None
        if self._gpu:
            self._backend.finish(self._async_stream)
        else:
            self._backend.finish()

    # ------------------------------------------------------------------ state
    def _transit_view(self, dtype: torch.dtype) -> torch.Tensor:
        assert self._transit is not None
        n = self._transit.numel() // torch.empty((), dtype=dtype).element_size()
        return self._transit[: n * torch.empty((), dtype=dtype).element_size()].view(dtype)

    def get_output_transit_buffer(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The output transit buffer, which holds the results when the handle was built with
        ``copy_output_to_user=False`` (then ``output_data`` is left untouched), as a 1-D view of
        ``dtype`` (default: the handle's dtype, else uint32)."""
        if self._transit is None:
            raise RuntimeError(
                "this handle was built with copy_output_to_user=True: results go straight into output_data and "
                "there is no output transit buffer (build it with copy_output_to_user=False to use one)"
            )
        return self._transit_view(dtype or self.dtype or torch.uint32)

    def reset_flags(self) -> None:
        """Collective (every rank, nothing in flight): zero the synchronisation flags; also
        clears a failure. Bounded by the shmem bootstrap timeout."""
        self._barrier("ccl_reset_in")
        self._backend.reset_flags()
        self._barrier("ccl_reset_out")

    def _barrier(self, tag: str) -> None:
        if self._gpu:
            import mori_core.shmem as shmem

            shmem.exchange(tag, None)
        else:
            import torch.distributed as dist

            dist.barrier()

    def check_error(self) -> None:
        """Raise RuntimeError when a wait for a peer timed out (the message names the peer);
        the GPU work of every call ends even then (each wait is bounded)."""
        e = self._backend.error()
        if e:
            raise RuntimeError(e)

    def engine_for(self, nbytes: int) -> str:
        """The engine path a call of ``nbytes`` takes ("sm", "ce", "sm-oneshot", "sm-twoshot",
        "reference"): all-gather: input bytes per rank; all-to-all: bytes of one peer's chunk;
        all-reduce: input bytes."""
        return self._backend.choose(int(nbytes))

    @property
    def heap_bytes(self) -> int:
        """Symmetric-heap bytes this handle holds."""
        return int(self._backend.heap_bytes)

    def close(self) -> None:
        """Collective: a last barrier with every peer, then free the heap buffers. Idempotent;
        also run by shmem_finalize. Close handles in the same order on every rank."""
        self._backend.close()

    def __enter__(self) -> "_Collective":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AllgatherSdma(_Collective):
    """All-gather: rank r's first ``count`` elements of ``input_data`` land at
    ``output_data[r*count:(r+1)*count]`` on every rank (any dtype; bytes are moved).

    Buffer sizes are bytes per rank: ``input_buffer_size`` bounds one call's input,
    ``output_buffer_size`` its output (``npes * count`` elements). ``transit_buffer_size``
    alone splits evenly between the two (upstream's default: 512 MiB)."""

    _KIND = "allgather"

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: Optional[int] = None,
        output_buffer_size: Optional[int] = None,
        transit_buffer_size: Optional[int] = None,
        copy_output_to_user: bool = True,
        *,
        engine: Optional[str] = None,
        options: Optional[CclOptions] = None,
    ) -> None:
        super().__init__(my_pe, npes, input_buffer_size, output_buffer_size, transit_buffer_size,
                         copy_output_to_user, None, engine, options)
        self._registered: set[int] = set()

    def __call__(self, input_data: torch.Tensor, output_data: torch.Tensor, count: int, stream: Any = None) -> bool:
        """All-gather ``count`` elements per rank on ``stream`` (default: the current stream).
        Returns True; errors raise (ValueError for bad arguments, RuntimeError for a failure)."""
        self._run(input_data, output_data, count, stream)
        return True

    def register_output_buffer(self, tensor: torch.Tensor) -> None:
        """Accepted for MORI compatibility. Upstream registers an output tensor so the copies
        write into it directly; here every output is written directly (the peers' data is
        pulled straight into ``output_data``), so registering only records the tensor."""
        self._registered.add(tensor.data_ptr())

    def deregister_output_buffer(self, tensor: torch.Tensor) -> None:
        self._registered.discard(tensor.data_ptr())

    def is_output_registered(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._registered


class All2allSdma(_Collective):
    """All-to-all: chunk p (``count`` elements at ``input_data[p*count:]``) of rank r lands in
    chunk r of rank p's ``output_data``. Both tensors hold ``npes * count`` elements; input and
    output must not overlap. ``count`` is in elements of the tensors' dtype."""

    _KIND = "all2all"

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: Optional[int] = None,
        output_buffer_size: Optional[int] = None,
        transit_buffer_size: Optional[int] = None,
        copy_output_to_user: bool = True,
        *,
        engine: Optional[str] = None,
        options: Optional[CclOptions] = None,
    ) -> None:
        super().__init__(my_pe, npes, input_buffer_size, output_buffer_size, transit_buffer_size,
                         copy_output_to_user, None, engine, options)

    def __call__(self, input_data: torch.Tensor, output_data: torch.Tensor, count: int, stream: Any = None) -> float:
        """All-to-all on ``stream``. Returns the host seconds the call took (upstream returns a
        synchronised execution time; the GPU work here stays asynchronous on ``stream``)."""
        t0 = time.perf_counter()
        self._run(input_data, output_data, count, stream)
        return time.perf_counter() - t0


class AllreduceSdma(_Collective):
    """All-reduce (sum) of ``count`` elements of ``dtype`` (bf16, fp16, fp32, int32, uint32;
    upstream's default dtype is uint32). Floats are summed in fp32 in rank order and rounded
    once, so every rank and every engine returns the same bits. In place: pass the same tensor
    or use :meth:`allreduce_inplace`. ``mode`` is accepted for upstream compatibility (every
    engine works eagerly and inside CUDA graph capture)."""

    _KIND = "allreduce"
    DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint32)

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: Optional[int] = None,
        output_buffer_size: Optional[int] = None,
        transit_buffer_size: Optional[int] = None,
        copy_output_to_user: bool = True,
        dtype: torch.dtype = torch.uint32,
        mode: str = "eager",
        *,
        engine: Optional[str] = None,
        options: Optional[CclOptions] = None,
    ) -> None:
        if dtype not in self.DTYPES:
            raise ValueError(f"Unsupported dtype {dtype}. Supported: {list(self.DTYPES)}")
        if mode not in ("eager", "graph"):
            raise ValueError(f"mode={mode!r} must be 'eager' or 'graph'")
        self.mode = mode
        super().__init__(my_pe, npes, input_buffer_size, output_buffer_size, transit_buffer_size,
                         copy_output_to_user, dtype, engine, options)

    def __call__(self, input_data: torch.Tensor, output_data: torch.Tensor, count: int, stream: Any = None) -> bool:
        """Out-of-place all-reduce on ``stream``; returns True (errors raise)."""
        self._run(input_data, output_data, count, stream)
        return True

    def allreduce_inplace(self, data: torch.Tensor, count: int, stream: Any = None) -> bool:
        """In-place all-reduce: the sum overwrites ``data`` (whatever copy_output_to_user)."""
        target, nbytes = data, check_tensors(self._KIND, self.npes, self.my_pe, data, data, count, self.device,
                                              self.dtype, self.input_buffer_size, self.output_buffer_size)
        if self._gpu:
            code = self._backend.run(data.data_ptr(), target.data_ptr(), nbytes, stream_handle(stream, self.device))
            self.last_path = self._backend.path_names[code]
        else:
            self._backend.run(data, target, count)
            self.last_path = "reference"
        return True

