"""Inter-node MORI-EP (InterNode, InterNodeV1, InterNodeV1LL, AsyncLL): the public names.

``EpDispatchCombineOp(config)`` with an inter-node kernel type returns an
:class:`InterNodeEpDispatchCombineOp`; the kernels, the NVSHMEM bring-up and the routing
semantics live in the inter-node engine (:mod:`mori_core.ops.engines.internode`), and so do
the network-path switches (``MORI_EP_INTERNODE_PATH``, ``MORI_EP_INTERNODE_PUT_ROWS``).
"""

from __future__ import annotations

from mori_core.ops.dispatch_combine import InterNodeEpDispatchCombineOp
from mori_core.ops.engines.internode import (
    PATH_ENV,
    PUT_ROWS_ENV,
    ensure_network,
    load_internode,
    network_bytes,
    network_path_from_env,
)

__all__ = [
    "PATH_ENV",
    "PUT_ROWS_ENV",
    "InterNodeEpDispatchCombineOp",
    "ensure_network",
    "load_internode",
    "network_bytes",
    "network_path_from_env",
]
