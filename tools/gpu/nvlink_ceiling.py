"""What the NVLink fabric of this host moves with its copy engines: the ceiling an EP kernel's
bytes are measured against (docs/ep.md, issue #31).

One process drives every visible GPU. Each GPU sends BYTES to every other GPU at once
(cudaMemcpyPeerAsync, one stream per (source, destination) pair: the all-to-all an EP dispatch or
combine makes), or to one peer only (a single pair, one direction). Wall time from issuing the
copies to the end of the last one, median of REPS; GB/s = bytes one GPU sends / time (it receives
as much at the same time).

    python3 tools/gpu/nvlink_ceiling.py [MB per pair, default 53 (EP4 x 4096 tokens: ~159 MB
                                        leave a rank for its 3 peers) and 128] [reps]
"""
from __future__ import annotations

import ctypes
import glob
import os
import statistics
import sys
import time

import torch


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded (by soname), else the one next to its packages."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    roots = [os.path.dirname(torch.__file__)] + sys.path
    for root in roots:
        for path in glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True):
            try:
                return ctypes.CDLL(path)
            except OSError:
                pass
    raise OSError("libcudart not found")


def main() -> int:
    world = torch.cuda.device_count()
    if world < 2:
        print("nvlink_ceiling: needs 2 or more GPUs")
        return 2
    torch.cuda.init()
    for d in range(world):
        torch.empty(1, device=f"cuda:{d}")  # a context on every device
    rt = _cudart()
    rt.cudaMemcpyPeerAsync.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                       ctypes.c_void_p]
    rt.cudaMemcpyPeerAsync.restype = ctypes.c_int
    rt.cudaSetDevice.argtypes = [ctypes.c_int]
    rt.cudaDeviceEnablePeerAccess.argtypes = [ctypes.c_int, ctypes.c_uint]
    for i in range(world):
        rt.cudaSetDevice(i)
        for j in range(world):
            if i != j:
                rt.cudaDeviceEnablePeerAccess(j, 0)  # 704 = already enabled: fine
    rt.cudaGetLastError()
    sizes = [int(float(v) * 1e6) for v in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["53", "128"])]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    name = torch.cuda.get_device_name(0)
    print(f"### NVLink copy-engine ceiling, {world}x {name} (cudaMemcpyPeerAsync, median of {reps}; GB/s = bytes one "
          "GPU sends / time)")
    print("| pattern | MB per pair | us | GB/s per GPU out |")
    print("|---|---|---|---|")
    verified = True
    for nbytes in sizes:
        src = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}").fill_(i) for i in range(world)]
        dst = {(i, j): torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{j}")
               for i in range(world) for j in range(world) if i != j}
        streams = {(i, j): torch.cuda.Stream(device=i) for (i, j) in dst}
        for pattern, pairs in (("all-to-all (every GPU to every peer)", list(dst)), ("one pair, one direction", [(0, 1)])):
            times = []
            for rep in range(reps + 2):
                for d in range(world):
                    torch.cuda.synchronize(d)
                t0 = time.perf_counter()
                for (i, j) in pairs:
                    rc = rt.cudaMemcpyPeerAsync(dst[(i, j)].data_ptr(), j, src[i].data_ptr(), i, nbytes,
                                                streams[(i, j)].cuda_stream)
                    if rc != 0:
                        raise RuntimeError(f"cudaMemcpyPeerAsync {i}->{j} failed: error {rc}")
                for d in range(world):
                    torch.cuda.synchronize(d)
                if rep >= 2:
                    times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            out_bytes = nbytes * (world - 1 if len(pairs) > 1 else 1)
            print(f"| {pattern} | {nbytes / 1e6:.0f} | {t * 1e6:.0f} | {out_bytes / t / 1e9:.0f} |")
        verified &= all(bool((dst[(i, j)][:: max(1, nbytes // 64)] == i).all()) for (i, j) in dst)
        del src, dst
    print(f"copies verified (sampled bytes hold the source's value): {'yes' if verified else 'NO'}")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
