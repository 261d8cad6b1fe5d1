"""MORI's CCO communicator API (``mori.cco``) on mori_core's bootstrap.

MORI's EPv2 op takes a :class:`Communicator` instead of a global shmem instance. Here a
Communicator is a handle on mori_core's symmetric heap (:mod:`mori_core.shmem`, bootstrapped
from the unique id) on GPUs, or on a torch.distributed (gloo) group on machines without one,
where the EPv2 op runs mori_core's reference engine.
"""

from mori_core.cco.cco import DevCommRequirements
from mori_core.cco.communicator import Communicator, DevCommHandle, UniqueId, get_unique_id

__all__ = ["Communicator", "DevCommHandle", "DevCommRequirements", "UniqueId", "get_unique_id"]
