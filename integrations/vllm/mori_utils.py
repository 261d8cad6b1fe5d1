"""MORI-EP operator construction for the vLLM adapter (seed 002's ``mori_utils``).

:class:`MoriEpConfig` is what one MoE layer needs from the EP operator (shape, dtypes,
capacity); :func:`create_mori_ep_op` turns it into a ``mori_core`` operator: the GPU
:class:`~mori_core.ops.EpDispatchCombineOp` on GPUs (symmetric memory must already be
initialised on the EP group), the reference operator over ``torch.distributed`` elsewhere
(CPU processes with a gloo group: vLLM-CPU and the CI tests).

This module imports neither vLLM nor anything GPU-only, so the GPU check and the MoE
benchmark use it on machines without vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

# Environment variables of the adapter (documented in docs/vllm.md).
ENV_FP8_DISPATCH = "VLLM_MORI_EP_USE_FP8_DISPATCH"
ENV_BLOCK_NUM = "VLLM_MORI_EP_BLOCK_NUM"
ENV_WARPS_PER_BLOCK = "VLLM_MORI_EP_WARPS_PER_BLOCK"
ENV_INTERNODE_KERNEL = "VLLM_MORI_EP_INTERNODE_KERNEL"

# Kernel types for EP groups that span nodes; InterNodeV1 is MORI's (and vLLM's) default,
# InterNodeV1LL its low-latency choice.
INTERNODE_KERNELS = ("InterNodeV1", "InterNodeV1LL", "InterNode", "AsyncLL")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

# Dtypes the EP combine accumulates; other activation dtypes are combined in float32.
_COMBINE_DTYPES = (torch.bfloat16, torch.float32)


def env_flag(name: str, default: bool = False) -> bool:
    """Parse a boolean environment variable; anything but 1/0/true/false/yes/no/on/off is an error."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use 1/0 (or true/false, yes/no, on/off)")


def env_positive_int(name: str) -> Optional[int]:
    """Parse an optional positive-integer environment variable (None when unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return value


def use_fp8_dispatch_from_env() -> bool:
    """True when ``VLLM_MORI_EP_USE_FP8_DISPATCH`` asks for FP8 token transport."""
    return env_flag(ENV_FP8_DISPATCH)


def combine_dtype_for(activation_dtype: torch.dtype) -> torch.dtype:
    """The dtype expert outputs travel in during combine (bf16/fp32 as is, others as fp32)."""
    return activation_dtype if activation_dtype in _COMBINE_DTYPES else torch.float32


@dataclass(frozen=True)
class LaunchSettings:
    """Grid of the dispatch/combine kernels: ``block_num`` blocks of ``warp_num_per_block`` warps."""

    block_num: int
    warp_num_per_block: int


def launch_settings_for(device: torch.device) -> LaunchSettings:
    """Pick the kernels' default grid for ``device`` (the operator config's launch values).

    NVIDIA: one block per SM with 16 warps -- the value mori_core's launch table measured
    best on H200 from ~1k tokens per rank, and its fallback for other GPUs (dispatch and
    combine run between the expert GEMMs, not overlapped with them, so they may use the
    whole GPU). AMD: 80 x 16, the intra-node setting stock vLLM uses for MI300.
    ``VLLM_MORI_EP_BLOCK_NUM`` / ``VLLM_MORI_EP_WARPS_PER_BLOCK`` override either value;
    ``MORI_EP_LAUNCH_CONFIG_MODE=AUTO`` makes mori_core choose per call by batch size
    instead. CPU (reference operator): the values are accepted and unused.
    """
    block_num, warps = 80, 16
    if device.type == "cuda" and torch.cuda.is_available() and getattr(torch.version, "hip", None) is None:
        block_num = int(torch.cuda.get_device_properties(device).multi_processor_count)
    block_num = env_positive_int(ENV_BLOCK_NUM) or block_num
    warps = env_positive_int(ENV_WARPS_PER_BLOCK) or warps
    return LaunchSettings(block_num=block_num, warp_num_per_block=warps)


@dataclass(frozen=True)
class EpTopology:
    """Which kernel family serves an EP group: IntraNode on one node, an inter-node type when
    the group spans nodes (``gpu_per_node`` ranks of the group per node)."""

    kernel_type: str
    gpu_per_node: int


def select_ep_topology(world_size: int, ranks_on_first_node: int) -> EpTopology:
    """MORI's selection as vLLM applies it: IntraNode when the EP group sits on one node, else an
    inter-node type (``VLLM_MORI_EP_INTERNODE_KERNEL``, default InterNodeV1; InterNodeV1LL for
    decode-latency deployments) with ``gpu_per_node`` = the group's ranks per node.

    Args:
        world_size: EP group size.
        ranks_on_first_node: ranks of the group on the node of its rank 0 (vLLM's
            ``in_the_same_node_as(cpu_group, 0)`` count); nodes must hold equal shares.
    """
    if not 1 <= ranks_on_first_node <= world_size:
        raise ValueError(f"ranks_on_first_node={ranks_on_first_node} must be in [1, world_size={world_size}]")
    if ranks_on_first_node == world_size:
        return EpTopology("IntraNode", _pow2_at_least(world_size))
    kernel = os.environ.get(ENV_INTERNODE_KERNEL, "InterNodeV1").strip() or "InterNodeV1"
    if kernel not in INTERNODE_KERNELS:
        raise ValueError(f"{ENV_INTERNODE_KERNEL}={kernel!r} must be one of {list(INTERNODE_KERNELS)}")
    gpn = ranks_on_first_node
    if gpn & (gpn - 1) or gpn > 8 or world_size % gpn:
        raise ValueError(
            f"the EP group has {gpn} ranks on its first node and {world_size} in all: the inter-node kernels need "
            "the same power-of-two number (<= 8) of ranks on every node"
        )
    return EpTopology(kernel, gpn)


@dataclass(frozen=True)
class MoriEpConfig:
    """What one MoE layer needs from an EP dispatch/combine operator.

    Layers with equal configs share one operator (the manager caches by this value).

    Args:
        rank: this process's rank in the EP group.
        world_size: EP group size (IntraNode kernels: 1..8 GPUs of one node).
        hidden_dim: token hidden size.
        dispatch_dtype: widest dtype dispatch will carry (activations, or FP8 when the
            tokens are quantised before dispatch).
        activation_dtype: the model's activation dtype (experts return rows of it).
        scale_dim: float32 scales per dispatched token (0: none; 1: per-token; H/128: blocks).
        max_num_tokens_per_rank: most tokens one rank passes to one dispatch.
        num_local_experts: experts per rank (expert ``e`` lives on rank ``e // num_local_experts``).
        num_experts_per_token: top-k.
        kernel_type: kernel family (see :func:`select_ep_topology`).
        gpu_per_node: ranks of the EP group per node (0: the whole group, IntraNode).
    """

    rank: int
    world_size: int
    hidden_dim: int
    dispatch_dtype: torch.dtype
    activation_dtype: torch.dtype
    scale_dim: int
    max_num_tokens_per_rank: int
    num_local_experts: int
    num_experts_per_token: int
    kernel_type: str = "IntraNode"
    gpu_per_node: int = 0

    def __post_init__(self) -> None:
        positive = ("world_size", "hidden_dim", "max_num_tokens_per_rank", "num_local_experts", "num_experts_per_token")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MoriEpConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"MoriEpConfig.rank={self.rank} must be in [0, world_size={self.world_size})")
        if self.scale_dim < 0:
            raise ValueError(f"MoriEpConfig.scale_dim must be >= 0, got {self.scale_dim}")
        if self.scale_dim > 0 and self.hidden_dim % self.scale_dim:
            raise ValueError(
                f"MoriEpConfig.scale_dim={self.scale_dim} must divide hidden_dim={self.hidden_dim} "
                "(one scale per equal group of channels)"
            )

    @property
    def combine_dtype(self) -> torch.dtype:
        """Dtype of the rows combine carries."""
        return combine_dtype_for(self.activation_dtype)

    @property
    def num_experts(self) -> int:
        """Global number of experts."""
        return self.num_local_experts * self.world_size

    def max_token_type_size(self) -> int:
        """Bytes per element of the widest token dtype the operator carries (sizes its buffers)."""
        return max(self.dispatch_dtype.itemsize, self.activation_dtype.itemsize, self.combine_dtype.itemsize)

    def to_op_config(self, launch: LaunchSettings) -> Any:
        """The ``mori_core.ops.EpDispatchCombineConfig`` of this layer shape and kernel family.
        Inter-node types get MORI's V1 grid (96 blocks, 64 of them staging network rows, 8 warps)
        unless ``VLLM_MORI_EP_BLOCK_NUM`` / ``VLLM_MORI_EP_WARPS_PER_BLOCK`` are set."""
        from mori_core.ops import EpDispatchCombineConfig, EpDispatchCombineKernelType

        if self.kernel_type == "IntraNode":
            grid = dict(warp_num_per_block=launch.warp_num_per_block, block_num=launch.block_num,
                        gpu_per_node=_pow2_at_least(self.world_size))
        else:
            grid = dict(warp_num_per_block=env_positive_int(ENV_WARPS_PER_BLOCK) or 8,
                        block_num=env_positive_int(ENV_BLOCK_NUM) or 96, rdma_block_num=64,
                        gpu_per_node=self.gpu_per_node)
        return EpDispatchCombineConfig(
            data_type=self.dispatch_dtype,
            rank=self.rank,
            world_size=self.world_size,
            hidden_dim=self.hidden_dim,
            scale_dim=self.scale_dim,
            scale_type_size=torch.float32.itemsize if self.scale_dim else 0,
            max_token_type_size=self.max_token_type_size(),
            max_num_inp_token_per_rank=self.max_num_tokens_per_rank,
            num_experts_per_rank=self.num_local_experts,
            num_experts_per_token=self.num_experts_per_token,
            kernel_type=EpDispatchCombineKernelType[self.kernel_type],
            **grid,
        )


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def create_mori_ep_op(
    config: MoriEpConfig,
    device: torch.device,
    group: Optional[dist.ProcessGroup] = None,
    launch: Optional[LaunchSettings] = None,
) -> Any:
    """Create the EP operator for ``config`` on ``device``.

    Args:
        config: layer shape and dtypes.
        device: a CUDA device selects the GPU operator (``mori_core.shmem`` must already be
            initialised on the EP group, see :class:`~mori_integrations.vllm.all2all.MoriEpAll2AllManager`);
            any other device selects the reference operator, which communicates over ``group``.
        group: the EP process group (reference operator only; None = default group).
        launch: kernel grid; default :func:`launch_settings_for` ``(device)``.
    """
    launch = launch or launch_settings_for(device)
    op_config = config.to_op_config(launch)
    if device.type == "cuda":
        from mori_core.ops import EpDispatchCombineOp

        return EpDispatchCombineOp(op_config)
    from mori_core.ops.reference import ReferenceEpDispatchCombineOp

    return ReferenceEpDispatchCombineOp(op_config, group=group, device=device)
