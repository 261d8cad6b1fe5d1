"""``MoriEpAll2AllManager``: the EP group's owner of MORI-EP symmetric memory and operators.

vLLM builds one all2all manager per EP group and process, when it creates the group's
device communicator (before the model loads). On GPUs this manager initialises
``mori_core.shmem`` on the EP group (the group's gloo ``cpu_group`` carries the bootstrap);
on CPU processes it needs nothing (the reference operator talks over the gloo group).
``get_handle`` creates one operator per distinct layer config and caches it; ``destroy``
finalises the operators and then shmem, so an engine can be torn down and rebuilt in one
process.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional

import torch

from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase
from vllm.logger import init_logger

from mori_integrations.vllm.mori_utils import (
    EpTopology,
    LaunchSettings,
    MoriEpConfig,
    create_mori_ep_op,
    launch_settings_for,
    select_ep_topology,
)

logger = init_logger(__name__)

# Process-group names registered for shmem bootstrap must be unique per process.
_GROUP_IDS = itertools.count()


class MoriEpAll2AllManager(All2AllManagerBase):
    """All2all manager of ``all2all_backend="mori_ep"``.

    Args:
        cpu_group: the EP group's gloo group (vLLM's ``GroupCoordinator.cpu_group``).
        tcp_store_group: stateless group of elastic EP (not supported; must be None).
    """

    def __init__(self, cpu_group: Any, tcp_store_group: Optional[Any] = None) -> None:
        if tcp_store_group is not None:
            raise ValueError("all2all_backend='mori_ep' does not support elastic EP (stateless EP groups)")
        super().__init__(cpu_group, tcp_store_group)
        # IntraNode on one node; an inter-node kernel type when the group spans nodes (MORI's rule).
        self.topology: EpTopology = select_ep_topology(self.world_size, _ranks_on_first_node(cpu_group))
        self.device = _ep_device()
        self.launch: LaunchSettings = launch_settings_for(self.device)
        self._ops: dict[MoriEpConfig, Any] = {}
        self._lock = threading.Lock()
        self._shmem_group: Optional[str] = None
        if self.device.type == "cuda":
            self._init_shmem()
        logger.info(
            "mori_ep all2all manager: rank %d/%d on %s, %s (gpu_per_node %d), launch %d blocks x %d warps",
            self.rank,
            self.world_size,
            self.device,
            self.topology.kernel_type,
            self.topology.gpu_per_node,
            self.launch.block_num,
            self.launch.warp_num_per_block,
        )

    def _init_shmem(self) -> None:
        import mori_core.shmem as shmem

        name = f"mori_ep_{next(_GROUP_IDS)}"
        torch._C._distributed_c10d._register_process_group(name, self.cpu_group)
        shmem.shmem_torch_process_group_init(name)
        self._shmem_group = name

    def get_handle(self, kwargs: dict[str, Any]) -> Any:
        """The cached EP operator for the layer described by ``kwargs`` (``MoriEpConfig`` fields)."""
        config = MoriEpConfig(
            **{**kwargs, "kernel_type": self.topology.kernel_type, "gpu_per_node": self.topology.gpu_per_node}
        )
        if config.rank != self.rank or config.world_size != self.world_size:
            raise ValueError(
                f"layer config (rank={config.rank}, world_size={config.world_size}) does not match the EP "
                f"group (rank={self.rank}, world_size={self.world_size})"
            )
        with self._lock:
            op = self._ops.get(config)
            if op is None:
                op = create_mori_ep_op(config, self.device, group=self.cpu_group, launch=self.launch)
                self._ops[config] = op
            return op

    def destroy(self) -> None:
        """Release every operator, then symmetric memory. Safe to call twice."""
        with self._lock:
            ops, self._ops = list(self._ops.values()), {}
        for op in ops:
            close = getattr(op, "close", None)  # GPU operators return their symmetric buffers
            if callable(close):
                close()
        del ops
        if self._shmem_group is not None:
            import mori_core.shmem as shmem

            if torch.cuda.is_available():
                torch.cuda.synchronize(self.device)
            shmem.shmem_finalize()
            self._shmem_group = None


def _ranks_on_first_node(cpu_group: Any) -> int:
    """Ranks of the EP group on the node of its rank 0 (vLLM's node test over the group)."""
    from vllm.distributed.parallel_state import in_the_same_node_as

    return sum(bool(x) for x in in_the_same_node_as(cpu_group, source_rank=0))


def _ep_device() -> torch.device:
    """The device this process's experts run on (vLLM sets the CUDA device before the groups)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if current_platform.is_cpu():
        return torch.device("cpu")
    raise ValueError(
        f"all2all_backend='mori_ep' runs on CUDA/ROCm GPUs or CPU processes, not on {current_platform.device_name}"
    )
