"""MORI-CCL: collectives on the symmetric heap (MORI's ``mori.ccl`` API).

* :class:`AllgatherSdma`, :class:`All2allSdma`, :class:`AllreduceSdma` (sum: bf16, fp16, fp32,
  int32, uint32) and :class:`AllGatherIntoTensor` (+ :class:`DataType`, :func:`size_of`), built
  as ``Cls(my_pe, npes, input_buffer_size=, output_buffer_size=, copy_output_to_user=, ...)``
  over an initialised :mod:`mori_core.shmem`, called as ``op(input, output, count, stream)``,
  with ``start_async`` / ``wait_async``, eagerly or inside CUDA graph capture.
* Two engines, chosen by size or forced (``engine=`` / ``MORI_CCL_ENGINE``): copy engines
  (``"ce"``: cudaMemcpyAsync between IPC-mapped heap buffers, synchronised by stream memory
  operations -- no SM moves or waits; NVIDIA's counterpart of upstream's SDMA) and SM kernels
  (``"sm"``: one-shot / two-shot all-reduce, pull all-gather / all-to-all). Tuning knobs:
  :mod:`mori_core.ccl.options`.
* Without a GPU the same classes run a CPU reference over torch.distributed (gloo).
* ``MORI_ENABLE_SDMA`` (upstream needs it set) is accepted and has no effect here.

Not provided (upstream's hierarchical / multi-node and sub-group classes):
``HierAllGather``, ``InterNodeRingAllgather``, ``IntraNodeSubGroupAllgatherSdma``,
``IntraNodeSubGroupBroadcastSdma``.
"""

from __future__ import annotations

from typing import Any

from mori_core.ccl.collectives import All2allSdma, AllgatherSdma, AllreduceSdma
from mori_core.ccl.into_tensor import AllGatherIntoTensor, DataType, size_of
from mori_core.ccl.options import CclOptions

__all__ = [
    "All2allSdma",
    "AllgatherSdma",
    "AllreduceSdma",
    "AllGatherIntoTensor",
    "CclOptions",
    "DataType",
    "size_of",
]

_NOT_PROVIDED = {
    "HierAllGather",
    "InterNodeRingAllgather",
    "IntraNodeSubGroupAllgatherSdma",
    "IntraNodeSubGroupBroadcastSdma",
    "hier_allgather_reference",
    "inter_node_ring_reference",
}


def __getattr__(name: str) -> Any:
    if name in _NOT_PROVIDED:
        raise ImportError(f"mori.ccl.{name} is not provided by mori-suite (intra-node collectives only; see docs/ccl.md)")
    raise AttributeError(f"module 'mori_core.ccl' has no attribute {name!r}")
