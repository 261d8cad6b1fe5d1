"""MORI-EP: expert-parallel dispatch/combine (API-compatible with AMD's ``mori.ops``).

* :class:`EpDispatchCombineConfig`, :class:`EpDispatchCombineKernelType`,
  :class:`EpDispatchCombineQuantType` — configuration (MORI's fields and defaults).
* :class:`EpDispatchCombineOp` — the operator: one front door over the kernel engine of
  ``config.kernel_type`` (IntraNode: CUDA IPC symmetric memory + NVLink kernels; inter-node:
  NVSHMEM; both need :mod:`mori_core.shmem` initialised first). See :mod:`.engines`.
* :class:`ReferenceEpDispatchCombineOp` — the same op over the reference engine, plain torch on
  torch.distributed (gloo on CPU, NCCL on GPU): test oracle and CPU fallback.

Semantics are documented in ``docs/ep.md``.
"""

from mori_core.ops.config import (
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineQuantType,
    decode_src_token_pos,
    encode_src_token_pos,
)
from mori_core.ops.dispatch_combine import EpDispatchCombineOp, gpu_ops_available
from mori_core.ops.errors import EpOpError
from mori_core.ops.reference import ReferenceEpDispatchCombineOp

__all__ = [
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchCombineQuantType",
    "EpOpError",
    "ReferenceEpDispatchCombineOp",
    "decode_src_token_pos",
    "encode_src_token_pos",
    "gpu_ops_available",
]
