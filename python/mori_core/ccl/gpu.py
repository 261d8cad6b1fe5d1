"""The GPU engines of MORI-CCL: a thin owner of the native handle (``mori_core._C.CclHandle``)
that lives on the symmetric heap of :mod:`mori_core.shmem`."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from mori_core.ccl.options import CclOptions

KIND_CODES = {"allgather": 0, "all2all": 1, "allreduce": 2}
# torch dtype -> the native reduce type (uint32 sums as int32: same bits mod 2**32).
RED_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int32: 4, torch.uint32: 4}


def native_ccl() -> Optional[Any]:
    """``mori_core._C`` when this build has the CCL kernels, else None."""
    try:
        from mori_core import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "CclHandle") else None


def gpu_ccl_available() -> bool:
    """True when this build has the CCL kernels and torch sees a CUDA device."""
    return native_ccl() is not None and torch.cuda.is_available()


class GpuBackend:
    """One handle's native state on this rank's GPU (created collectively: every rank
    constructs the same collectives in the same order)."""

    def __init__(self, kind: str, my_pe: int, npes: int, input_bytes: int, dtype: Optional[torch.dtype],
                 opts: CclOptions) -> None:
        import mori_core.shmem as shmem

        core = native_ccl()
        if core is None:
            raise RuntimeError("this mori_core build has no CCL kernels (built without nvcc/hipcc)")
        shmem.require_initialized(my_pe, npes)
        self.device = torch.device("cuda", shmem.shmem_device())
        self.path_names: list[str] = list(core.ccl_path_names)
        red = RED_CODES[dtype] if dtype is not None else 0
        self._h = core.CclHandle(
            kind=KIND_CODES[kind], rank=my_pe, npes=npes, input_bytes=int(input_bytes), red=red,
            engine=opts.engine_code, ce_min_bytes=opts.ce_min_bytes, oneshot_max_bytes=opts.oneshot_max_bytes,
            ar_ce_min_bytes=opts.ar_ce_min_bytes, sm_blocks=opts.blocks_for(kind), sm_threads=opts.sm_threads,
            reduce_blocks=opts.reduce_blocks, timeout_s=opts.timeout_s, ce_batch=opts.ce_batch,
            ce_signal_copy=opts.ce_signal == "copy", ce_split=opts.split_for(kind),
            ce_piece_min_bytes=opts.ce_piece_min_bytes,
        )
        try:
            # Every rank allocated the same heap offsets (and, doing so, reached this point).
            shmem.verify_symmetric(f"ccl_{kind}", int(self._h.sync_offset))
        except BaseException:
            self._h.close()
            raise
        # shmem_finalize closes the handle before the heap goes (collective, like the handle).
        ref = weakref.ref(self)
        shmem.register_finalizer(lambda: (lambda b: b.close() if b is not None else None)(ref()))
        self.run = self._h.run
        self.start = self._h.start
        self.finish = self._h.finish

    @property
    def heap_bytes(self) -> int:
        return int(self._h.heap_bytes)

    @property
    def ce_available(self) -> bool:
        return bool(self._h.ce_available)

    def choose(self, nbytes: int) -> str:
        return self.path_names[self._h.choose(int(nbytes))]

    def error(self) -> str:
        return str(self._h.error())

    def reset_flags(self) -> None:
        self._h.reset_flags()

    def close(self) -> None:
        self._h.close()


# torch's current stream as an int without building a Stream object (what torch's own
# compiler uses; a few microseconds less per call, which small collectives feel).
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(stream: Any, device: torch.device) -> int:
    """The integer handle of ``stream``: None -> torch's current stream on ``device`` (also
    inside CUDA graph capture), an int as is (0: the legacy default stream), a torch stream."""
    if stream is None:
        if _raw_current_stream is not None:
            return int(_raw_current_stream(device.index))
        return torch.cuda.current_stream(device).cuda_stream
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)
