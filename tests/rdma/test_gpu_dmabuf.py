"""The GPU half of GPUDirect registration, which needs no NIC: exporting GPU
memory as a dma-buf (what ibv_reg_dmabuf_mr consumes). Runs on GPU machines."""

from __future__ import annotations

import os
from types import ModuleType

import pytest


@pytest.mark.gpu
def test_export_covers_the_region_and_keeps_the_current_device(rdma_testing: ModuleType) -> None:
    torch = pytest.importorskip("torch")
    dev = torch.cuda.device_count() - 1  # a device that is not current when there are several
    torch.cuda.set_device(0)
    # A sub-allocation at an odd offset, as a framework's caching allocator hands out.
    block = torch.empty(3 << 20, dtype=torch.uint8, device=f"cuda:{dev}")
    ptr, size = block.data_ptr() + 12345, 1 << 20
    r = rdma_testing.export_gpu_dmabuf(dev, ptr, size)
    assert torch.cuda.current_device() == 0, "the export changed the caller's current device (MORI PR #682)"
    if not r["ok"]:
        # Drivers without dma-buf support must say so (the backend then tries peer memory).
        assert "cuMemGetHandleForAddressRange" in r["error"] or "hipMemGetHandleForAddressRange" in r["error"], r
        pytest.skip(f"this driver cannot export dma-bufs: {r['error']}")
    page = os.sysconf("SC_PAGE_SIZE")
    assert r["offset"] == ptr % page
    assert r["dmabuf_size"] >= r["offset"] + size and r["dmabuf_size"] % page == 0


@pytest.mark.gpu
def test_export_of_host_memory_fails_cleanly(rdma_testing: ModuleType) -> None:
    import numpy as np

    host = np.zeros(1 << 16, dtype=np.uint8)
    r = rdma_testing.export_gpu_dmabuf(0, host.ctypes.data, host.nbytes)
    assert not r["ok"] and r["error"]
