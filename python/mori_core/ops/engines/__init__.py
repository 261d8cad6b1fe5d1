"""Kernel engines behind :class:`~mori_core.ops.EpDispatchCombineOp` (interface: :mod:`.base`).

=====================================  ============================================  ==========================
module                                 kernel types                                  moves data with
=====================================  ============================================  ==========================
``intranode`` (+ ``_standard_moe``)    IntraNode, IntraNodeLL                        CUDA IPC + NVLink kernels
``internode``                          InterNode, InterNodeV1, InterNodeV1LL,        NVSHMEM + NVLink kernels
                                       AsyncLL
``reference`` (+ ``_standard_moe``)    any (ReferenceEpDispatchCombineOp)            torch.distributed
=====================================  ============================================  ==========================

This package imports nothing: the op imports an engine module only when a config selects it.
"""
