"""GPU-side measurements for ``bench io --backend xgmi``, taken in the initiator process.

The transfer engine's figures are host-observed (submit to completion seen).
These put GPU facts beside them, measured in the same run on the same two GPUs:
a plain copy-engine copy of the same bytes and the scatter-copy kernel alone
(its GPU time in a CUDA graph, without any host work), so the fixed cost of a
batch can be named as latency minus GPU time.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from mori_core.bench.table import median


def copy_baseline(nbytes: int, src_dev: int, dst_dev: int, iters: int, warmup: int) -> tuple[list[float], list[float]]:
    """A plain peer copy (torch ``copy_``, copy engines) of ``nbytes`` contiguous bytes.

    Returns (wall us from the call until both GPUs are idle, host us spent in ``copy_``) per iteration.
    """
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    pc = time.perf_counter_ns
    wall, host = [], []
    for i in range(warmup + iters):
        t0 = pc()
        dst.copy_(src, non_blocking=True)
        t1 = pc()
        torch.cuda.synchronize(dst_dev)
        torch.cuda.synchronize(src_dev)
        t2 = pc()
        if i >= warmup:
            wall.append((t2 - t0) / 1e3)
            host.append((t1 - t0) / 1e3)
    return wall, host


class KernelTimer:
    """Times the XGMI scatter-copy kernel alone, GPU ``src_dev`` -> peer GPU ``dst_dev``, in this process."""

    def __init__(self, src_dev: int, dst_dev: int, nbytes: int) -> None:
        import torch
        from mori_core import _C

        self.torch = torch
        self.testing = _C._xgmi_testing
        self.src_dev, self.dst_dev = src_dev, dst_dev
        self.src = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
        if src_dev != dst_dev:
            self.testing.enable_peer_access(src_dev, dst_dev)

    def _segments(self, msg: int, batch: int) -> tuple[list[int], list[int], list[int]]:
        offs = [i * 2 * msg for i in range(batch)]
        s, d = self.src.data_ptr(), self.dst.data_ptr()
        return [d + o for o in offs], [s + o for o in offs], [msg] * batch

    def _graph_us(self, launch: Callable[[int], None], reps: int = 20, iters: int = 10) -> Optional[float]:
        """GPU time per launch: ``reps`` launches captured in a CUDA graph, replayed between two events."""
        torch = self.torch
        try:
            with torch.cuda.device(self.src_dev):
                g = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                with torch.cuda.stream(side):
                    launch(side.cuda_stream)  # warm-up outside the capture
                torch.cuda.synchronize()
                with torch.cuda.graph(g, capture_error_mode="thread_local"):
                    cur = torch.cuda.current_stream().cuda_stream
                    for _ in range(reps):
                        launch(cur)
                times = []
                for _ in range(iters + 2):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    g.replay()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) * 1e3 / reps)
                return median(times[2:])
        except Exception as e:  # a driver without capture support for a node type: report, do not fail
            print(f"(CUDA graph timing unavailable: {type(e).__name__}: {e})")
            return None

    def kernel(self, msg: int, batch: int, piece: int = 16384, threads: int = 256,
               iters: int = 30) -> dict[str, Optional[float]]:
        """The scatter kernel on ``batch`` segments of ``msg`` bytes: eager (event pair around each launch,
        back to back) and GPU time (graph)."""
        dsts, srcs, sizes = self._segments(msg, batch)
        return self.kernel_segments(dsts, srcs, sizes, piece, threads, 0, iters)

    def kernel_segments(self, dsts: list[int], srcs: list[int], sizes: list[int], piece: int = 16384,
                        threads: int = 256, max_blocks: int = 0, iters: int = 30) -> dict[str, Optional[float]]:
        """The scatter kernel on the given segments (pointers into this timer's buffers), in one shape."""
        torch = self.torch

        def launch(stream: int) -> None:
            self.testing.scatter_copy(dsts, srcs, sizes, stream, piece, threads, max_blocks)

        with torch.cuda.device(self.src_dev):
            stream = torch.cuda.current_stream().cuda_stream
            times = []
            for i in range(iters + 3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                launch(stream)
                b.record()
                if i >= 3:
                    times.append((a, b))
            torch.cuda.synchronize()
            eager = median([a.elapsed_time(b) * 1e3 for a, b in times])
        return {"eager_us": eager, "gpu_us": self._graph_us(launch)}
