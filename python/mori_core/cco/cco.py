"""Low-level names of MORI's ``mori.cco.cco`` that EP callers read.

MORI's CCO builds device communicators (GDA queue pairs, LSA teams) from these requirements.
mori_core has no device communicator object: its EP kernels reach peers through the shmem heap
(NVLink) and NVSHMEM (network). The requirements are accepted so callers written for MORI run;
what a :class:`~mori_core.cco.communicator.DevCommHandle` reports is the team layout.
"""

from __future__ import annotations

from dataclasses import dataclass

# Which GDA (GPU-initiated network) connections a device communicator asks for.
GDA_CONNECTION_NONE = 0
GDA_CONNECTION_RAIL = 1
GDA_CONNECTION_CROSSNODE = 2


@dataclass
class DevCommRequirements:
    """What a device communicator needs (MORI's field names; mori_core reads none of them:
    its inter-node kernels size their NVSHMEM queue pairs from the EP config)."""

    gda_connection_type: int = GDA_CONNECTION_CROSSNODE
    gda_context_count: int = 1
