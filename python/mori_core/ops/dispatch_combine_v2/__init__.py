"""MORI's EPv2 API (``mori.ops.dispatch_combine_v2``) on mori_core's EP engine.

:class:`EpDispatchCombineConfig`, :class:`EpDispatchCombineOp` (built on a
:class:`mori_core.cco.Communicator`) and :class:`EpDispatchRoutingHandle`, with MORI's names,
defaults, derived sizes and errors. The op is a face of the v1 engine (same kernels, symmetric
heap and bootstrap), see :mod:`mori_core.ops.dispatch_combine_v2.op` and docs/ep.md.
"""

from mori_core.ops.dispatch_combine_v2.config import EpDispatchCombineConfig
from mori_core.ops.dispatch_combine_v2.op import EpDispatchCombineOp
from mori_core.ops.dispatch_combine_v2.routing import EpDispatchRoutingHandle

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineOp", "EpDispatchRoutingHandle"]
