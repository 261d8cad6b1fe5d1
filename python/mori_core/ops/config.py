"""MORI-EP configuration: the config dataclass, kernel/quant enums and derived buffer sizes.

Field names, order and defaults follow AMD MORI's ``mori.ops.EpDispatchCombineConfig`` so
code written for MORI constructs it unchanged. Everything here is plain Python (no torch
device work), so it imports on any machine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Union

# Hard limits of the IntraNode kernels (checked by EpDispatchCombineConfig.validate()).
MAX_WORLD_SIZE_INTRANODE = 8  # one NVLink/XGMI node
MAX_EXPERTS_PER_TOKEN = 32  # top-k rows are copied by one warp lane each


class EpDispatchCombineKernelType(enum.IntEnum):
    """Kernel families (values as MORI's ``mori::moe::KernelType``).

    This build implements ``IntraNode`` (and ``IntraNodeLL``, which runs the same
    IntraNode kernels: they are already latency-oriented on NVLink). The inter-node
    types are accepted by the config but :class:`EpDispatchCombineOp` raises
    ``NotImplementedError`` for them.
    """

    IntraNode = 0
    InterNode = 1
    InterNodeV1 = 2
    InterNodeV1LL = 3
    AsyncLL = 4
    IntraNodeLL = 5

    def __str__(self) -> str:
        return self.name


IMPLEMENTED_KERNEL_TYPES = (EpDispatchCombineKernelType.IntraNode, EpDispatchCombineKernelType.IntraNodeLL)
# Served by mori_core.ops.internode (NVSHMEM across nodes, NVLink inside a node).
INTERNODE_KERNEL_TYPES = (
    EpDispatchCombineKernelType.InterNode,
    EpDispatchCombineKernelType.InterNodeV1,
    EpDispatchCombineKernelType.InterNodeV1LL,
    EpDispatchCombineKernelType.AsyncLL,
)
MAX_WORLD_SIZE_INTERNODE = 64  # destination-rank masks are 64-bit
MAX_GPUS_PER_NODE = 8  # MORI's MAX_GPUS_PER_NODE: one NVLink/XGMI domain


class EpDispatchCombineQuantType(enum.IntEnum):
    """Combine-side transport quantisation (MORI names). Only ``None_`` is implemented."""

    None_ = 0
    Fp8DirectCast = 1
    Fp8BlockwiseQuant = 2
    Fp4BlockwiseQuant = 3

    def __str__(self) -> str:
        return self.name


_QUANT_ALIASES = {
    "none": EpDispatchCombineQuantType.None_,
    "fp8_direct_cast": EpDispatchCombineQuantType.Fp8DirectCast,
    "fp8_blockwise": EpDispatchCombineQuantType.Fp8BlockwiseQuant,
    "fp4_blockwise": EpDispatchCombineQuantType.Fp4BlockwiseQuant,
}


def normalize_quant_type(quant_type: Union[str, EpDispatchCombineQuantType]) -> EpDispatchCombineQuantType:
    """Map MORI's string aliases ("none", "fp8_direct_cast", ...) or the enum to the enum."""
    if isinstance(quant_type, EpDispatchCombineQuantType):
        return quant_type
    if isinstance(quant_type, str) and quant_type.strip().lower() in _QUANT_ALIASES:
        return _QUANT_ALIASES[quant_type.strip().lower()]
    raise ValueError(f"quant_type={quant_type!r} is not one of {sorted(_QUANT_ALIASES)}")


def normalize_kernel_type(kernel_type: Any) -> EpDispatchCombineKernelType:
    """Accept our enum, an int, a name string, or another enum with a matching ``name``/``value``
    (e.g. AMD MORI's pybind enum), and return :class:`EpDispatchCombineKernelType`."""
    if isinstance(kernel_type, EpDispatchCombineKernelType):
        return kernel_type
    if isinstance(kernel_type, str):
        try:
            return EpDispatchCombineKernelType[kernel_type]
        except KeyError:
            pass
    name = getattr(kernel_type, "name", None)
    if isinstance(name, str) and name in EpDispatchCombineKernelType.__members__:
        return EpDispatchCombineKernelType[name]
    try:
        return EpDispatchCombineKernelType(int(getattr(kernel_type, "value", kernel_type)))
    except (TypeError, ValueError):
        raise ValueError(
            f"kernel_type={kernel_type!r} is not one of {[k.name for k in EpDispatchCombineKernelType]}"
        ) from None


@dataclass
class EpDispatchCombineConfig:
    """Configuration of one expert-parallel dispatch/combine operator (MORI's fields and defaults).

    Args:
        data_type: token dtype (kept for MORI compatibility; the kernels use the dtype of the
            tensor passed to each call, which may differ between dispatch and combine).
        rank: this process's rank in the EP group.
        world_size: number of EP ranks (IntraNode: 1..8, all on one node).
        hidden_dim: maximum hidden size of a token; calls may pass a smaller one.
        scale_dim: number of scale values per token carried by dispatch (0: no scales).
        scale_type_size: bytes per scale element (e.g. 4 for float32 scales).
        max_token_type_size: bytes of the largest token dtype the op will carry; sizes every
            token buffer (typically 4 = float32 so bf16/fp8 fit too).
        max_num_inp_token_per_rank: most tokens any rank passes to one dispatch.
        num_experts_per_rank: experts hosted by each rank (expert e lives on rank
            ``e // num_experts_per_rank``).
        num_experts_per_token: top-k.
        warp_num_per_block: default warps per block of the kernels (per-call override).
        block_num: default blocks of the kernels (per-call override).
        max_total_recv_tokens: cap on tokens one rank can receive per dispatch (0 = no cap:
            ``world_size * max_num_inp_token_per_rank``, which can never overflow). Smaller caps
            save memory; a dispatch that would exceed one is reported as an error.
        use_external_inp_buf: combine mode default. True = push (the op copies the ``input`` rows
            of combine into the source ranks' staging buffers); False = pull/zero-copy (peers read
            rows straight from this rank's registered buffer, see
            ``get_registered_combine_input_buffer``).
        kernel_type: kernel family: IntraNode (and its alias IntraNodeLL) on NVLink; InterNode,
            InterNodeV1, InterNodeV1LL and AsyncLL across nodes (mori_core.ops.internode).
        gpu_per_node: GPUs per node (inter-node kernels: a power of two <= 8 dividing world_size;
            rank r is local rank r % gpu_per_node of node r // gpu_per_node).
        rdma_block_num: inter-node kernels: blocks of the dispatch that stage rows for the
            network while the others write node peers (InterNodeV1/V1LL; 0 = every block does both).
        num_qp_per_pe: RDMA queue pairs per peer: sets NVSHMEM_IBGDA_NUM_RC_PER_PE when this op
            initialises NVSHMEM (IBGDA only; proxy transports have one proxy thread).
        quant_type: combine transport quantisation, "none" only in this build.
    """

    data_type: Any
    rank: int
    world_size: int
    hidden_dim: int
    scale_dim: int
    scale_type_size: int
    max_token_type_size: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    warp_num_per_block: int = 8
    block_num: int = 80
    max_total_recv_tokens: int = 0
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"EpDispatchCombineConfig: {msg}")

        for name in (
            "rank",
            "world_size",
            "hidden_dim",
            "scale_dim",
            "scale_type_size",
            "max_token_type_size",
            "max_num_inp_token_per_rank",
            "num_experts_per_rank",
            "num_experts_per_token",
            "warp_num_per_block",
            "block_num",
            "max_total_recv_tokens",
            "gpu_per_node",
            "rdma_block_num",
            "num_qp_per_pe",
        ):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool), f"{name} must be an int, got {v!r}")
        need(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        need(0 <= self.rank < self.world_size, f"rank={self.rank} must be in [0, world_size={self.world_size})")
        need(self.hidden_dim >= 1, f"hidden_dim must be >= 1, got {self.hidden_dim}")
        need(self.scale_dim >= 0, f"scale_dim must be >= 0, got {self.scale_dim}")
        need(
            self.scale_dim == 0 or self.scale_type_size in (1, 2, 4, 8),
            f"scale_type_size must be 1, 2, 4 or 8 when scale_dim > 0, got {self.scale_type_size}",
        )
        need(
            self.max_token_type_size in (1, 2, 4),
            f"max_token_type_size must be 1, 2 or 4 bytes, got {self.max_token_type_size}",
        )
        need(
            self.max_num_inp_token_per_rank >= 1,
            f"max_num_inp_token_per_rank must be >= 1, got {self.max_num_inp_token_per_rank}",
        )
        need(self.num_experts_per_rank >= 1, f"num_experts_per_rank must be >= 1, got {self.num_experts_per_rank}")
        need(
            1 <= self.num_experts_per_token <= MAX_EXPERTS_PER_TOKEN,
            f"num_experts_per_token must be in [1, {MAX_EXPERTS_PER_TOKEN}], got {self.num_experts_per_token}",
        )
        need(self.warp_num_per_block >= 1, f"warp_num_per_block must be >= 1, got {self.warp_num_per_block}")
        need(self.block_num >= 1, f"block_num must be >= 1, got {self.block_num}")
        need(self.max_total_recv_tokens >= 0, f"max_total_recv_tokens must be >= 0, got {self.max_total_recv_tokens}")
        need(
            self.gpu_per_node >= 1 and self.gpu_per_node & (self.gpu_per_node - 1) == 0,
            f"gpu_per_node must be a power of two, got {self.gpu_per_node}",
        )
        kt = normalize_kernel_type(self.kernel_type)
        if kt in IMPLEMENTED_KERNEL_TYPES:
            need(
                self.world_size <= MAX_WORLD_SIZE_INTRANODE,
                f"world_size={self.world_size} exceeds {MAX_WORLD_SIZE_INTRANODE} for kernel_type {kt.name} "
                "(intra-node EP spans one node)",
            )
        if kt in INTERNODE_KERNEL_TYPES:
            need(
                self.world_size <= MAX_WORLD_SIZE_INTERNODE,
                f"world_size={self.world_size} exceeds {MAX_WORLD_SIZE_INTERNODE} for kernel_type {kt.name}",
            )
            need(
                self.gpu_per_node <= MAX_GPUS_PER_NODE and self.world_size % self.gpu_per_node == 0,
                f"gpu_per_node={self.gpu_per_node} must be <= {MAX_GPUS_PER_NODE} and divide "
                f"world_size={self.world_size} for kernel_type {kt.name}",
            )
            need(self.num_qp_per_pe >= 1, f"num_qp_per_pe must be >= 1, got {self.num_qp_per_pe}")
        normalize_quant_type(self.quant_type)

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_experts(self) -> int:
        """Total experts across the EP group."""
        return self.num_experts_per_rank * self.world_size

    def max_num_tokens_to_send_per_rank(self) -> int:
        """Rows one rank can send to one peer in a dispatch (each token at most once per rank)."""
        return self.max_num_inp_token_per_rank

    def max_num_tokens_to_send(self) -> int:
        """Stride of the flat source index used by :meth:`get_dispatch_src_token_pos`."""
        return self.world_size * self.max_num_inp_token_per_rank

    def max_num_tokens_to_recv_per_rank(self) -> int:
        """Per-source share of the receive capacity (MORI's definition)."""
        if self.max_total_recv_tokens > 0:
            per = -(-self.max_total_recv_tokens // self.world_size)
            return min(per, self.max_num_inp_token_per_rank)
        return self.max_num_inp_token_per_rank

    def max_num_tokens_to_recv(self) -> int:
        """Rows of every dispatch output (capacity); valid rows are ``total_recv[0]``."""
        return self.world_size * self.max_num_tokens_to_recv_per_rank()


def encode_src_token_pos(config: EpDispatchCombineConfig, src_rank: int, src_token: int) -> int:
    """Flat source index as returned by ``get_dispatch_src_token_pos`` (MORI's FlatTokenIndex):
    ``src_rank * max_num_tokens_to_send() + src_token``."""
    return src_rank * config.max_num_tokens_to_send() + src_token


def decode_src_token_pos(config: EpDispatchCombineConfig, flat_idx: int) -> tuple[int, int]:
    """Inverse of :func:`encode_src_token_pos`: ``(src_rank, src_token)``."""
    stride = config.max_num_tokens_to_send()
    return int(flat_idx) // stride, int(flat_idx) % stride
