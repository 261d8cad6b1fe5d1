"""MORI EPv2 configuration: field names, defaults, derived sizes and errors as MORI's
``mori.ops.dispatch_combine_v2.EpDispatchCombineConfig`` (what SGLang's EPv2 dispatcher reads).

The v2 op is a second face of mori_core's EP engine, so this config also knows the v1 config
that serves it (:meth:`EpDispatchCombineConfig.engine_config`). Plain Python: imports on any
machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mori_core.ops.config import EpDispatchCombineConfig as EngineConfig
from mori_core.ops.config import EpDispatchCombineKernelType

QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise")
COMBINE_MODES = ("gather", "scatter")
# Upstream's backend names; every one of them runs mori_core's kernels here (see docs/ep.md).
KERNEL_BACKENDS = ("auto", "flydsl", "hip", "mori_core")
FP8_BLOCK = 128  # channels per fp8_blockwise combine scale
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)
_FP8 = tuple(
    dt for dt in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e4m3fnuz", None)) if dt is not None
)
_ELEM = {torch.bfloat16: 2, torch.float32: 4, **{dt: 1 for dt in _FP8}}
if _FP4 is not None:
    _ELEM[_FP4] = 1  # nominal: two e2m1 values share a byte, token_nbytes says hidden / 2
_COMBINE = (torch.bfloat16, torch.float32)
# Geometry when some but not all of it is pinned (MORI's single-shot fallback).
_FALLBACK = dict(dispatch_block_num=64, combine_block_num=80, warp_num_per_block=16, combine_warp_num_per_block=4)
# Token-count buckets of the automatic schedule (the bounds of mori_core's Hopper launch table).
_SCHEDULE_BOUNDS = (256, 1024, None)


@dataclass
class EpDispatchCombineConfig:
    """One EPv2 dispatch/combine op.

    Args:
        rank, world_size: this rank and the EP group size.
        hidden_dim: channels per token.
        max_num_inp_token_per_rank: most tokens a rank passes to one dispatch.
        num_experts_per_rank: experts per rank (expert ``e`` lives on ``e // num_experts_per_rank``).
        num_experts_per_token: top-k.
        data_type: token dtype of both legs (bf16 or fp32) unless the two below are set.
        dispatch_data_type, combine_data_type: an asymmetric op (both or neither): e.g. fp8 or
            fp4 (``float4_e2m1fn_x2``) dispatch, bf16 combine. Gather mode, no quant, no StdMoE.
        scale_dim, scale_type_size: per-token scales dispatch forwards (0: none). They arrive as
            opaque int32 dwords, ``ceil(scale_dim * scale_type_size / 4)`` per token.
        combine_mode: "gather" (peers read this rank's expert outputs: mori_core's pull
            combine) or "scatter" (this rank writes them to the sources: push).
        quant_type: combine wire quantisation: "none", "fp8_direct_cast", "fp8_blockwise";
            anything but "none" selects scatter.
        dispatch_block_num, combine_block_num, warp_num_per_block, combine_warp_num_per_block:
            kernel grid; all None = automatic (a per-token-count ``schedule`` from mori_core's
            launch table), any one set = that value and the fallback for the rest.
        schedule: ``((max_tokens or None, dispatch_blocks, dispatch_warps, combine_blocks,
            combine_warps), ...)``: the first bucket whose bound covers the call's tokens wins.
        enable_std_moe: allow ``convert_dispatch_output`` / ``convert_combine_input`` (bf16).
        max_total_recv_tokens: cap on rows one rank receives per dispatch (0: world * max tokens).
        gpu_per_node: ranks per node; a smaller value than world_size selects mori_core's
            inter-node kernels (InterNodeV1; needs the NVSHMEM build).
        kernel_backend: MORI's backend name (auto, flydsl, hip, mori_core); all run mori_core.
        num_qp_per_pe: inter-node kernels: RDMA queue pairs per peer.
    """

    rank: int
    world_size: int
    hidden_dim: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    data_type: Any = torch.bfloat16
    dispatch_data_type: Any = None
    combine_data_type: Any = None
    scale_dim: int = 0
    scale_type_size: int = 0
    combine_mode: str = "gather"
    quant_type: str = "none"
    dispatch_block_num: Optional[int] = None
    combine_block_num: Optional[int] = None
    warp_num_per_block: Optional[int] = None
    combine_warp_num_per_block: Optional[int] = None
    schedule: Optional[tuple] = None
    enable_std_moe: bool = False
    max_total_recv_tokens: int = 0
    gpu_per_node: int = 8
    kernel_backend: str = "auto"
    num_qp_per_pe: int = 1

    def __post_init__(self) -> None:
        if (self.dispatch_data_type is None) != (self.combine_data_type is None):
            raise ValueError(
                "dispatch_data_type / combine_data_type must be set together (all-or-none): got "
                f"dispatch_data_type={self.dispatch_data_type}, combine_data_type={self.combine_data_type}"
            )
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"quant_type must be one of {QUANT_TYPES}, got {self.quant_type!r}")
        if self.combine_mode not in COMBINE_MODES:
            raise ValueError(f"combine_mode must be gather|scatter, got {self.combine_mode!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.quant_type != "none":
            self.combine_mode = "scatter"  # MORI quantises the combine wire in scatter mode only
        if self.dispatch_dtype not in _ELEM:
            raise ValueError(f"dispatch dtype {self.dispatch_dtype} is not one of {list(_ELEM)}")
        if self.combine_dtype not in _COMBINE:
            raise ValueError(f"combine dtype {self.combine_dtype} must be one of {list(_COMBINE)} (combine sums)")
        if self.token_nbytes % 16:
            raise ValueError(
                f"per-token transport bytes must be 16 B aligned; hidden_dim={self.hidden_dim}, "
                f"dispatch_dtype={self.dispatch_dtype} -> token_nbytes={self.token_nbytes}"
            )
        if self.is_asymmetric_dtype and (self.is_scatter or self.quant_type != "none" or self.enable_std_moe):
            raise ValueError(
                "combine_data_type (asymmetric dtype) requires combine_mode=gather, quant_type=none, "
                "enable_std_moe=False"
            )
        if (self.is_fp4 or self.is_fp8) and self.is_scatter:
            raise ValueError("plain fp4/fp8 token dtype is gather-only (fp8 combine quant uses quant_type)")
        if self.enable_std_moe and self.dispatch_dtype != torch.bfloat16:
            raise ValueError(f"enable_std_moe needs bf16 tokens, got {self.dispatch_dtype}")
        if self.fp8_blockwise and self.hidden_dim % FP8_BLOCK:
            raise ValueError(f"quant_type fp8_blockwise needs hidden_dim % {FP8_BLOCK} == 0, got {self.hidden_dim}")
        if self.scale_dim < 0 or (self.scale_dim > 0 and self.scale_type_size not in (1, 2, 4, 8)):
            raise ValueError(
                f"scale_dim={self.scale_dim} must be >= 0, and scale_type_size (got {self.scale_type_size}) "
                "1, 2, 4 or 8 bytes when scale_dim > 0"
            )
        self._resolve_geometry()
        self.engine_config().validate()  # ranks, sizes and limits of the engine, named by field

    # ------------------------------------------------------------------ geometry
    def _resolve_geometry(self) -> None:
        """All geometry None: automatic per-token-count schedule; anything pinned: honour it."""
        pinned = self.schedule is not None or any(getattr(self, k) is not None for k in _FALLBACK)
        if pinned:
            for k, v in _FALLBACK.items():
                if getattr(self, k) is None:
                    setattr(self, k, v)
        else:
            auto = auto_geometry(self.world_size, self.is_scatter)
            for k in _FALLBACK:
                setattr(self, k, auto[k])
            self.schedule = auto["schedule"]
        if self.schedule is not None:
            self.schedule = tuple(tuple(b) for b in self.schedule)
            for b in self.schedule:
                if len(b) != 5 or any(not isinstance(v, int) or v < 1 for v in b[1:]):
                    raise ValueError(f"schedule bucket {b!r} must be (max_tokens or None, db, dw, cb, cw), ints >= 1")
        for k in _FALLBACK:
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive int, got {v!r}")

    def launch_for(self, num_tokens: int) -> tuple[int, int, int, int]:
        """``(dispatch_blocks, dispatch_warps, combine_blocks, combine_warps)`` for a call of
        ``num_tokens`` tokens: the schedule's first covering bucket, else the fixed geometry."""
        for bound, db, dw, cb, cw in self.schedule or ():
            if bound is None or num_tokens <= bound:
                return db, dw, cb, cw
        return self.dispatch_block_num, self.warp_num_per_block, self.combine_block_num, self.combine_warp_num_per_block

    @classmethod
    def tuned(cls, **kwargs: Any) -> "EpDispatchCombineConfig":
        """A config whose unset geometry fields come from the automatic table (explicit ones win)."""
        auto = auto_geometry(int(kwargs["world_size"]), kwargs.get("combine_mode") == "scatter"
                             or kwargs.get("quant_type", "none") != "none")
        for k, v in auto.items():
            kwargs.setdefault(k, v)
        return cls(**kwargs)

    # ------------------------------------------------------------------ dtypes and sizes
    @property
    def dispatch_dtype(self) -> Any:
        """Dispatch transport dtype (``data_type`` unless ``dispatch_data_type`` is set)."""
        return self.dispatch_data_type if self.dispatch_data_type is not None else self.data_type

    @property
    def combine_dtype(self) -> Any:
        """Combine dtype (``data_type`` unless ``combine_data_type`` is set)."""
        return self.combine_data_type if self.combine_data_type is not None else self.data_type

    @property
    def is_fp4(self) -> bool:
        return _FP4 is not None and self.dispatch_dtype == _FP4

    @property
    def is_fp8(self) -> bool:
        return self.dispatch_dtype in _FP8

    @property
    def is_asymmetric_dtype(self) -> bool:
        return self.dispatch_dtype != self.combine_dtype

    @property
    def elem_size(self) -> int:
        """Bytes per dispatch element (fp4: a nominal 1; use :attr:`token_nbytes`)."""
        return _ELEM[self.dispatch_dtype]

    @property
    def combine_elem_size(self) -> int:
        return _ELEM[self.combine_dtype]

    @property
    def token_nbytes(self) -> int:
        """Dispatch bytes per token (fp4 packs two values per byte)."""
        return self.hidden_dim // 2 if self.is_fp4 else self.hidden_dim * self.elem_size

    @property
    def combine_token_nbytes(self) -> int:
        """Combine bytes per token."""
        return self.hidden_dim * self.combine_elem_size

    @property
    def dtype_str(self) -> str:
        return "fp4" if self.is_fp4 else ("fp8" if self.is_fp8 else "bf16")

    @property
    def is_scatter(self) -> bool:
        return self.combine_mode == "scatter"

    @property
    def fp8_direct_cast(self) -> bool:
        return self.quant_type == "fp8_direct_cast"

    @property
    def fp8_blockwise(self) -> bool:
        return self.quant_type == "fp8_blockwise"

    @property
    def combine_scale_dim(self) -> int:
        """fp32 scales per token of an fp8_blockwise combine (one per 128 channels)."""
        return self.hidden_dim // FP8_BLOCK if self.fp8_blockwise else 0

    @property
    def wire_elem_size(self) -> int:
        """Bytes per element a scatter combine puts on the wire (1 for the fp8 quant types)."""
        return 1 if self.quant_type != "none" else self.combine_elem_size

    @property
    def scale_dwords(self) -> int:
        """int32 dwords per token of the forwarded scales."""
        return -(-self.scale_dim * self.scale_type_size // 4)

    @property
    def max_recv(self) -> int:
        """Slot bound of a dispatch without a cap (world_size * max tokens)."""
        return self.world_size * self.max_num_inp_token_per_rank

    @property
    def effective_max_recv_per_rank(self) -> int:
        if self.max_total_recv_tokens <= 0:
            return self.max_num_inp_token_per_rank
        return min(-(-self.max_total_recv_tokens // self.world_size), self.max_num_inp_token_per_rank)

    @property
    def effective_max_recv(self) -> int:
        """Rows of every receive buffer (MORI's MaxNumTokensToRecv)."""
        return self.world_size * self.effective_max_recv_per_rank

    @property
    def is_internode(self) -> bool:
        """True when the group spans nodes (``gpu_per_node < world_size``)."""
        return 0 < self.gpu_per_node < self.world_size

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpu_per_node) if self.is_internode else 1

    # ------------------------------------------------------------------ the engine
    def engine_config(self) -> EngineConfig:
        """The mori_core (v1) config of the engine that serves this op.

        Scales travel as int32 dwords (the v2 contract); token buffers are sized for the wider
        of the two legs; gather = pull (zero-copy) combine, scatter = push."""
        kernel = EpDispatchCombineKernelType.InterNodeV1 if self.is_internode else EpDispatchCombineKernelType.IntraNode
        return EngineConfig(
            data_type=self.combine_dtype,
            rank=self.rank,
            world_size=self.world_size,
            hidden_dim=self.hidden_dim,
            scale_dim=self.scale_dwords,
            scale_type_size=4 if self.scale_dwords else 0,
            max_token_type_size=max(self.elem_size, self.combine_elem_size),
            max_num_inp_token_per_rank=self.max_num_inp_token_per_rank,
            num_experts_per_rank=self.num_experts_per_rank,
            num_experts_per_token=self.num_experts_per_token,
            warp_num_per_block=self.warp_num_per_block,
            block_num=self.dispatch_block_num,
            max_total_recv_tokens=self.max_total_recv_tokens,
            use_external_inp_buf=self.is_scatter,
            kernel_type=kernel,
            # IntraNode: the engine wants a power of two covering the group (<= 8)
            gpu_per_node=self.gpu_per_node if self.is_internode else min(8, 1 << (self.world_size - 1).bit_length()),
            num_qp_per_pe=self.num_qp_per_pe,
            quant_type=self.quant_type,
        )


def auto_geometry(world_size: int, scatter: bool) -> dict:
    """Automatic geometry: a schedule over token-count buckets from mori_core's launch table for
    the current GPU (one block per SM and 8 warps where it has no table; a nominal grid without a
    GPU, where the reference engine ignores it). The fixed fields hold the largest bucket."""
    from mori_core.ops.launch_config import auto_params

    if not torch.cuda.is_available():
        return dict(_FALLBACK, schedule=None)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    sms, major = int(props.multi_processor_count), int(props.major)
    combine_kernel = "combine_push" if scatter else "combine_pull"
    buckets = []
    for bound in _SCHEDULE_BOUNDS:
        n = bound if bound is not None else 1 << 20
        d = auto_params("dispatch", n, sms, major, world_size)
        c = auto_params(combine_kernel, n, sms, major, world_size)
        buckets.append((bound, d.block_num, d.warp_per_block, c.block_num, c.warp_per_block))
    last = buckets[-1]
    return dict(dispatch_block_num=last[1], warp_num_per_block=last[2], combine_block_num=last[3],
                combine_warp_num_per_block=last[4], schedule=tuple(buckets))
