"""Reference engine: MORI-EP dispatch/combine in plain torch over torch.distributed collectives.

Behind :class:`~mori_core.ops.ReferenceEpDispatchCombineOp` (the op with this engine). It is the
oracle of the GPU tests and a CPU fallback: with a gloo group it runs on any machine, with an
NCCL group on GPUs. The op gives it validated arguments; the semantics are those of the GPU
engines:

* dispatch sends each token once to every unique destination rank of its valid top-k expert
  ids (ids that are -1 or >= ``num_experts`` are dropped), carrying its full top-k ids,
  weights and (when ``scale_dim > 0``) scales. Outputs are capacity-sized
  (``max_num_tokens_to_recv()`` rows); valid rows are ``total_recv[0]``.
* Receive order here is deterministic: by source rank, then source token. The GPU op's order
  is arrival order; consumers must use ``get_dispatch_src_token_pos()`` rather than assume one.
* combine returns, per original token, the fp32-accumulated sum of the rows its unique
  destination ranks return (no weighting: the experts apply the gating weights), and the
  returned weight rows summed the same way. It uses the caller's own routing ``indices``.
  For the inter-node kernel types with several nodes the sum is hierarchical, as the GPU
  kernels compute it: per node in fp32 (ascending rank) rounded once to the combine dtype, then
  the node partials in fp32 in ascending node order (weights stay fp32 throughout).

Each call issues an ``all_gather`` of counts and one ``all_to_all_single`` of packed rows.
"""


from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mori_core.ops import combine_quant
from mori_core.ops.call_cache import RowBuffer, typed_view
from mori_core.ops.config import INTERNODE_KERNEL_TYPES, EpDispatchCombineConfig, normalize_kernel_type
from mori_core.ops.engines.base import CombineOutputs, DispatchOutputs, EpEngine
from mori_core.ops.launch_config import LaunchParams
from mori_core.ops.validation import DISPATCH_DTYPES

_SRC_POS_BYTES = 4  # int32 flat source index carried in every dispatched row


def dest_rank_mask(indices: torch.Tensor, config: EpDispatchCombineConfig) -> torch.Tensor:
    """[n, world] bool: token i goes to rank r (valid expert ids only, deduplicated per rank)."""
    n = indices.shape[0]
    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < config.num_experts)
    dest = torch.where(valid, idx // config.num_experts_per_rank, torch.full_like(idx, config.world_size))
    mask = torch.zeros(n, config.world_size + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(1, dest, True)
    return mask[:, : config.world_size]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a 2-D [n, c] tensor as [n, c * element_size] uint8 (works for n == 0 too)."""
    return t.contiguous().view(torch.uint8)


class ReferenceEngine(EpEngine):
    """Plain-torch exchange over a process group (see the module docstring).

    Args:
        config: the operator config (``rank``/``world_size`` must match ``group``).
        group: process group to communicate over; None = the default group (or none at all
            when ``world_size == 1``).
        device: where outputs live; default = the current CUDA device for NCCL groups, else CPU.
    """

    def __init__(self, config: EpDispatchCombineConfig, group: Optional[dist.ProcessGroup] = None, *,
                 device: Optional[torch.device] = None) -> None:
        kt = normalize_kernel_type(config.kernel_type)
        # Inter-node types reduce per node before the network (see combine()).
        self._hierarchical = kt in INTERNODE_KERNEL_TYPES and config.gpu_per_node < config.world_size
        self._combine_quant = combine_quant.combine_quant_code(config)
        self.config = config
        self.group = group
        if config.world_size > 1 or (dist.is_available() and dist.is_initialized()):
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"world_size={config.world_size} needs torch.distributed to be initialized (or pass a group)"
                )
            ws, rk = dist.get_world_size(group), dist.get_rank(group)
            if ws != config.world_size or rk != config.rank:
                raise ValueError(
                    f"config (rank={config.rank}, world_size={config.world_size}) does not match the process "
                    f"group (rank={rk}, world_size={ws})"
                )
            self._backend = str(dist.get_backend(group))
        else:
            self._backend = "local"
        if device is None:
            use_cuda = "nccl" in self._backend and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self.device = torch.device(device)
        self._registered = torch.zeros(
            config.max_num_tokens_to_recv() * config.hidden_dim * config.max_token_type_size,
            dtype=torch.uint8,
            device=self.device,
        )
        self._state: Optional[dict] = None
        self.arg_device = None  # any one device: rows move to self.device for the exchange
        self.combine_dtypes = tuple(dt for dt in DISPATCH_DTYPES if dt.is_floating_point and dt.itemsize >= 2)
        self.launch_config_mode = "MANUAL"
        from mori_core.ops.engines.reference_standard_moe import ReferenceStandardMoe

        self.standard_moe = ReferenceStandardMoe(self)

    def _comm_device(self) -> torch.device:
        if "nccl" in self._backend and self.device.type == "cuda":
            return self.device
        if self._backend == "local":
            return self.device
        return torch.device("cpu")

    def _all_gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[world] int64 -> [world(src), world(dst)] matrix on every rank."""
        if self._backend == "local":
            return counts.view(1, -1).cpu()
        cdev = self._comm_device()
        parts = [torch.zeros_like(counts, device=cdev) for _ in range(self.config.world_size)]
        dist.all_gather(parts, counts.to(cdev), group=self.group)
        return torch.stack(parts).cpu()

    def _exchange(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """all_to_all_single of uint8 rows; returns received rows on self.device."""
        if self._backend == "local":
            return rows.to(self.device)
        cdev = self._comm_device()
        out = torch.empty(sum(recv_counts), rows.shape[1], dtype=torch.uint8, device=cdev)
        dist.all_to_all_single(
            out, rows.to(cdev), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.group
        )
        return out.to(self.device)

    # ------------------------------------------------------------------ launches
    def resolve_launch(
        self, kernel: str, num_tokens: int, block_num: int, rdma_block_num: int, warp_per_block: int
    ) -> LaunchParams:
        """Launch arguments are accepted for API parity and ignored: the config's values."""
        return LaunchParams(self.config.block_num, self.config.warp_num_per_block)

    def launch_dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                        indices: torch.Tensor, num_tokens: int, row_bytes: int, plan: LaunchParams, finish: bool
                        ) -> DispatchOutputs:
        """Send each token to its unique destination ranks; returns fresh capacity-sized outputs."""
        cfg = self.config
        has_weights, has_scales = weights is not None, scales is not None
        n, h, topk, world = num_tokens, int(input.shape[1]), cfg.num_experts_per_token, cfg.world_size

        mask = dest_rank_mask(indices, cfg)  # [n, world]
        send_tokens = [torch.nonzero(mask[:, r], as_tuple=False).flatten() for r in range(world)]
        send_counts = [int(t.numel()) for t in send_tokens]
        matrix = self._all_gather_counts(torch.tensor(send_counts, dtype=torch.int64, device=self.device))
        recv_counts = [int(c) for c in matrix[:, cfg.rank].tolist()]
        capacity = cfg.max_num_tokens_to_recv()
        per_rank_recv = matrix.sum(dim=0).tolist()
        for r, total in enumerate(per_rank_recv):
            if total > capacity:
                raise RuntimeError(
                    f"dispatch overflow: rank {r} would receive {int(total)} tokens but its capacity is {capacity} "
                    f"(max_total_recv_tokens={cfg.max_total_recv_tokens}); raise max_total_recv_tokens"
                )

        # Pack [payload | weights | indices | scales | src_pos] per (token, destination).
        src_pos = (cfg.rank * cfg.max_num_tokens_to_send() + torch.arange(n, device=input.device)).to(torch.int32)
        w = weights if has_weights else torch.zeros(n, topk, dtype=torch.float32, device=input.device)
        parts = [_as_bytes(input), _as_bytes(w), _as_bytes(indices)]
        if has_scales:
            parts.append(_as_bytes(scales))
        parts.append(_as_bytes(src_pos.view(n, 1)))
        packed = torch.cat(parts, dim=1)
        order = torch.cat(send_tokens)
        rows = packed.index_select(0, order)
        recv = self._exchange(rows, send_counts, recv_counts)
        total = recv.shape[0]

        # Unpack into capacity-sized outputs.
        sizes = [h * input.element_size(), topk * 4, topk * 4]
        if has_scales:
            sizes.append(cfg.scale_dim * scales.element_size())
        sizes.append(_SRC_POS_BYTES)
        fields = torch.split(recv, sizes, dim=1)
        dev = self.device
        out = torch.zeros(capacity, h, dtype=input.dtype, device=dev)
        out[:total] = fields[0].contiguous().view(input.dtype).view(total, h)
        out_weights = torch.zeros(capacity, topk, dtype=torch.float32, device=dev)
        out_weights[:total] = fields[1].contiguous().view(torch.float32).view(total, topk)
        out_indices = torch.full((capacity, topk), -1, dtype=torch.int32, device=dev)
        out_indices[:total] = fields[2].contiguous().view(torch.int32).view(total, topk)
        out_scales = None
        if has_scales:
            out_scales = torch.zeros(capacity, cfg.scale_dim, dtype=scales.dtype, device=dev)
            out_scales[:total] = fields[3].contiguous().view(scales.dtype).view(total, cfg.scale_dim)
        recv_src_pos = fields[-1].contiguous().view(torch.int32).view(total)
        total_recv = torch.tensor([total], dtype=torch.int32, device=dev)

        self._state = {
            "round": (self._state or {}).get("round", 0) + 1,
            "recv_weights": out_weights[:total] if has_weights else None,
            "recv_indices": out_indices[:total],
            "recv_scales": out_scales[:total] if has_scales else None,
            "num_tokens": n,
            "mask": mask.to(dev),
            "send_tokens": [t.to(dev) for t in send_tokens],
            "send_counts": send_counts,
            "recv_counts": recv_counts,
            "total_recv": total,
            "src_pos": recv_src_pos,
        }
        return out, out_weights, out_scales, out_indices, total_recv

    def launch_combine(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor,
                       num_tokens: int, rows: RowBuffer, input_rows: int, push: bool, plan: LaunchParams, finish: bool
                       ) -> CombineOutputs:
        """Return the rows to their sources and sum them per original token (fp32; hierarchical
        per node for the inter-node kernel types)."""
        cfg = self.config
        st = self._state
        has_weights = weights is not None
        total, h, topk = st["total_recv"], int(input.shape[1]), cfg.num_experts_per_token

        mask = dest_rank_mask(indices, cfg).to(self.device)
        if not torch.equal(mask, st["mask"]):
            raise ValueError(
                "indices route some token to a different set of ranks than at dispatch: combine needs this "
                "rank's own routing indices as passed to dispatch"
            )
        if push:
            if input.shape[0] < total:
                raise ValueError(f"input has {input.shape[0]} rows, fewer than the {total} tokens received by dispatch")
            sent = input[:total]
        else:
            sent = typed_view(self._registered, input.dtype, cfg.max_num_tokens_to_recv(), h)[:total]
        quant = self._combine_quant
        combine_quant.check_quantized_combine(quant, input.dtype, h)
        parts = [_as_bytes(sent.to(self.device))]
        if quant:  # every row travels as FP8 (+ scales) in the slot of a bf16 row
            parts[0] = combine_quant.encode_rows(sent.to(self.device), quant)
        if has_weights:
            if weights.shape[0] < total:
                raise ValueError(f"weights has {weights.shape[0]} rows, fewer than the {total} tokens received")
            parts.append(_as_bytes(weights[:total].to(self.device)))
        packed = torch.cat(parts, dim=1)
        back = self._exchange(packed, st["recv_counts"], st["send_counts"])

        n = st["num_tokens"]
        row_bytes = h * input.element_size()
        acc = torch.zeros(n, h, dtype=torch.float32, device=self.device)
        acc_w = torch.zeros(n, topk, dtype=torch.float32, device=self.device) if has_weights else None
        # Inter-node kernel types sum per node first (fp32, ascending rank, rounded once to the
        # combine dtype), then the node partials in fp32 in ascending node order; with one node
        # or one GPU per node that is the flat fp32 sum over ranks below.
        group = cfg.gpu_per_node if self._hierarchical else 1
        offset = 0
        for node0 in range(0, cfg.world_size, group):
            part = torch.zeros(n, h, dtype=torch.float32, device=self.device)
            part_w = torch.zeros(n, topk, dtype=torch.float32, device=self.device) if has_weights else None
            hit = torch.zeros(n, dtype=torch.bool, device=self.device)
            for r in range(node0, node0 + group):
                cnt = st["send_counts"][r]
                if cnt == 0:
                    continue
                chunk = back[offset : offset + cnt]
                offset += cnt
                tok = st["send_tokens"][r]
                hit[tok] = True
                if quant:  # every returned row travelled as FP8 (combine_quant)
                    vals = combine_quant.decode_rows(chunk[:, :row_bytes], h, quant)
                else:
                    vals = chunk[:, :row_bytes].contiguous().view(input.dtype).view(cnt, h)
                part.index_add_(0, tok, vals.to(torch.float32))
                if part_w is not None:
                    part_w.index_add_(0, tok, chunk[:, row_bytes:].contiguous().view(torch.float32).view(cnt, topk))
            tok = torch.nonzero(hit).flatten()
            if group > 1:
                part = part.to(input.dtype).to(torch.float32)
            acc.index_add_(0, tok, part[tok])
            if acc_w is not None:
                acc_w.index_add_(0, tok, part_w[tok])
        out = torch.zeros(cfg.max_num_inp_token_per_rank, h, dtype=input.dtype, device=self.device)
        out[:n] = acc.to(input.dtype)
        out_weights = None
        if acc_w is not None:
            out_weights = torch.zeros(cfg.max_num_inp_token_per_rank, topk, dtype=torch.float32, device=self.device)
            out_weights[:n] = acc_w
        return out, out_weights

    # ------------------------------------------------------------------ buffers and state
    def buffer_views(self) -> dict[str, Optional[torch.Tensor]]:
        """Only the registered combine input: outputs are fresh tensors of every call."""
        return {"combine_input": self._registered}

    def src_token_pos(self) -> torch.Tensor:
        if self._state is None:
            raise RuntimeError("get_dispatch_src_token_pos() needs a preceding dispatch()")
        return self._state["src_pos"].clone()

    def close(self) -> None:
        """Nothing to release collectively (plain tensors)."""
