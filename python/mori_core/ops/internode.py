"""Inter-node MORI-EP (InterNode, InterNodeV1, InterNodeV1LL, AsyncLL): the public names.

``EpDispatchCombineOp(config)`` with an inter-node kernel type returns an
:class:`InterNodeEpDispatchCombineOp`; the kernels, the NVSHMEM bring-up and the routing
semantics live in the inter-node engine (:mod:`mori_core.ops.engines.internode`).
"""

from __future__ import annotations

from mori_core.ops.dispatch_combine import InterNodeEpDispatchCombineOp
from mori_core.ops.engines.internode import ensure_network, load_internode, network_bytes

__all__ = ["InterNodeEpDispatchCombineOp", "ensure_network", "load_internode", "network_bytes"]
