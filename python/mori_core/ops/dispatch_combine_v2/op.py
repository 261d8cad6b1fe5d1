"""MORI's EPv2 op (``mori.ops.dispatch_combine_v2.EpDispatchCombineOp``) on mori_core's EP engine.

The v2 API is a second face of the same engine as the v1 op, not a second transport: the op owns
one engine op (:class:`mori_core.ops.EpDispatchCombineOp` on a GPU communicator -- IntraNode, or
InterNodeV1 when ``gpu_per_node < world_size`` -- and the reference engine
:class:`mori_core.ops.ReferenceEpDispatchCombineOp` on a CPU communicator) and translates:

* v2 ``dispatch(..., return_routing=True)`` returns an :class:`EpDispatchRoutingHandle`;
  v2 ``combine(input, weights, indices, routing=h)`` takes this rank's routing from the handle
  (MORI's v2 ignores the ``indices`` argument; SGLang passes the *received* ids there).
* gather combine = the engine's pull (zero-copy) combine, scatter = push. :meth:`combine_in_view`
  is the engine's registered combine buffer: expert outputs written there are combined without a
  copy, anything else is copied in first (gather) or pushed from where it is (scatter).
* Scales travel as int32 dwords (``recv_scales`` is ``[rows, ceil(scale bytes / 4)]`` int32).
* ``recv_cap`` sizes the returned views (``prepare_recv_cap`` tiers). The engine takes its capacity
  at launch, so nothing is compiled per tier; a dispatch that receives more rows than its cap
  keeps them in the buffers but outside the views (the caller's bound must cover the rows; the
  reference engine checks it and raises).
* ``fp4`` tokens (``float4_e2m1fn_x2``) travel as bytes.
* Combine sums the gating-weight rows along with the tokens, like MORI's v2.

No call synchronises the host (CUDA-graph capturable), except ``disp_tok_id_to_src_tok_id_local``
of a handle, which is built on first access.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from mori_core.ops.dispatch_combine_v2.config import EpDispatchCombineConfig
from mori_core.ops.dispatch_combine_v2.routing import EpDispatchRoutingHandle

_BYTE = getattr(torch, "float8_e4m3fn", torch.uint8)  # how fp4 bytes cross the engine (it moves bytes)


def _same(a: tuple, b: tuple) -> bool:
    """Whether two tuples hold the very same objects (the engine returned its cached views again)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class EpDispatchCombineOp:
    """EPv2 dispatch/combine over ``comm`` (a :class:`mori_core.cco.Communicator`).

    Construction is collective (every rank, same order). ``backend_name`` says which engine
    serves the op: "mori_core" (GPU kernels) or "mori_core.reference" (CPU).
    """

    def __init__(self, cfg: EpDispatchCombineConfig, comm: Any) -> None:
        if not isinstance(cfg, EpDispatchCombineConfig):
            raise TypeError(f"cfg must be mori_core.ops.dispatch_combine_v2.EpDispatchCombineConfig, got {type(cfg)}")
        if (comm.rank, comm.nranks) != (cfg.rank, cfg.world_size):
            raise ValueError(
                f"cfg rank/world_size ({cfg.rank}/{cfg.world_size}) differ from the communicator's "
                f"({comm.rank}/{comm.nranks})"
            )
        self.cfg = cfg
        self.comm = comm
        engine_cfg = cfg.engine_config()
        if comm.is_gpu:
            from mori_core.ops import EpDispatchCombineOp as EngineOp

            if cfg.is_internode and comm.lsa_size != cfg.gpu_per_node:
                raise ValueError(
                    f"gpu_per_node={cfg.gpu_per_node} differs from the ranks sharing a node ({comm.lsa_size})"
                )
            self._engine = EngineOp(engine_cfg)
            self.backend_name = "mori_core"
        else:
            from mori_core.ops import ReferenceEpDispatchCombineOp

            self._engine = ReferenceEpDispatchCombineOp(engine_cfg, group=comm.group, device=torch.device("cpu"))
            self.backend_name = "mori_core.reference"
        self.dev = self._engine.device
        self._recv_cap = cfg.effective_max_recv
        self.prepared_recv_caps: set[int] = {self._recv_cap}
        self._push = cfg.is_scatter
        self._sequence = 0
        self._last: Optional[dict] = None
        self._lec = torch.zeros(cfg.num_experts_per_rank, dtype=torch.int32, device=self.dev)
        self._empty = torch.empty(0, dtype=torch.int32, device=self.dev)
        self._launch_cache: dict[int, tuple[int, int, int, int]] = {}
        self._fp4 = cfg.is_fp4  # the config is not changed after the op is built
        # The GPU engine returns the same buffer views on every call, so the views of them this op
        # returns are built once per recv_cap / token count (tensor slicing costs ~1 us a view, and
        # a dispatch returns five): recv_cap -> (engine outputs, results), num_tokens -> the same.
        self._dispatch_views: dict[int, tuple[tuple, tuple]] = {}
        self._combine_views: dict[int, tuple[tuple, tuple]] = {}
        self._combine_in: Optional[torch.Tensor] = None
        self._closed = False

    # ------------------------------------------------------------------ capacity tiers
    def prepare_recv_cap(self, cap: int) -> None:
        """Allow ``dispatch(..., recv_cap=cap)``: views of ``cap`` receive rows (1..effective_max_recv).
        Nothing is compiled (the kernels take the capacity at launch); the tier is recorded."""
        self.prepared_recv_caps.add(self._check_cap(cap))

    def _check_cap(self, cap: Any) -> int:
        if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= self._recv_cap:
            raise ValueError(f"recv_cap={cap!r} must be an int in [1, effective_max_recv={self._recv_cap}]")
        return cap

    # ------------------------------------------------------------------ views
    def combine_in_view(self) -> torch.Tensor:
        """``[effective_max_recv, hidden]`` combine-dtype buffer combine reads without a copy: write
        expert outputs here (row = dispatch-output row) and pass it (or a leading slice) to combine."""
        if self._combine_in is None:
            self._combine_in = self._engine.get_registered_combine_input_buffer(self.cfg.combine_dtype, self.cfg.hidden_dim)
        return self._combine_in

    def local_expert_count(self) -> torch.Tensor:
        """int32 ``[num_experts_per_rank]``: received (row, local expert) pairs of the latest dispatch
        (device ops only). Call after dispatch, before combine."""
        last = self._require_last("local_expert_count()")
        cfg = self.cfg
        idx, total = last["indices"], last["total"]
        lo = cfg.rank * cfg.num_experts_per_rank
        rows = torch.arange(idx.shape[0], device=idx.device).view(-1, 1) < total.to(idx.device)
        local = (idx >= lo) & (idx < lo + cfg.num_experts_per_rank) & rows
        slot = (idx - lo).clamp(0, cfg.num_experts_per_rank - 1).to(torch.int64)
        self._lec.zero_()
        self._lec.scatter_add_(0, slot.flatten(), local.flatten().to(torch.int32))
        return self._lec

    def _require_last(self, what: str) -> dict:
        if self._last is None:
            raise RuntimeError(f"{what} needs a preceding dispatch()")
        return self._last

    def _launch(self, num_tokens: int) -> tuple[int, int, int, int]:
        p = self._launch_cache.get(num_tokens)
        if p is None:
            p = self._launch_cache[num_tokens] = self.cfg.launch_for(num_tokens)
        return p

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        scales: Optional[torch.Tensor],
        indices: torch.Tensor,
        *,
        routing: Optional[EpDispatchRoutingHandle] = None,
        return_routing: bool = False,
        recv_cap: Optional[int] = None,
        clone_routing: bool = True,
    ) -> tuple:
        """Send each token to the ranks of its top-k experts (once per rank).

        Args:
            input: ``[n, hidden]`` tokens of the dispatch dtype (fp4: ``[n, hidden / 2]``).
            weights: ``[n, topk]`` float32 gating weights, or None.
            scales: ``[n, scale_dim]`` per-token scales (``scale_type_size`` bytes each), or None.
            indices: ``[n, topk]`` int32 expert ids (-1: dropped).
            routing: replay a handle's routing (its ``indices`` are used when ``indices`` is None);
                the engine routes again, so on GPUs rows may take other slots than the first time.
            return_routing: also return the :class:`EpDispatchRoutingHandle` combine needs.
            recv_cap: rows of the returned views (default effective_max_recv); see the module doc.
            clone_routing: the handle keeps a copy of ``indices`` (False: a reference; the caller
                keeps the tensor unchanged until the combine).

        Returns:
            ``(out [cap, hidden], out_weights [cap, topk] f32, out_scales [cap, dwords] int32 or None,
            out_indices [cap, topk] int32, total_recv [1] int32)`` (+ the handle): views of the
            engine's receive buffers, valid rows ``total_recv[0]``, overwritten by the next dispatch.
        """
        if routing is not None and return_routing:
            raise ValueError("pass either routing= (replay) or return_routing=True, not both")
        if routing is not None and indices is None:
            indices = routing.disp_dest_tok_id_map
        cap = self._recv_cap if recv_cap is None else self._check_cap(recv_cap)
        cfg = self.cfg
        tokens = input
        if self._fp4 and input.dtype == cfg.dispatch_dtype:
            tokens = input.view(_BYTE)
        eng_scales = self._scales_as_dwords(scales)
        n = int(input.shape[0])
        db, dw, _, _ = self._launch(n)
        src = self._engine.dispatch(tokens, weights, eng_scales, indices, block_num=db, warp_per_block=dw)
        out, out_w, out_s, out_i, total = src
        if cap < self._recv_cap and not self.comm.is_gpu and int(total[0]) > cap:
            raise RuntimeError(
                f"dispatch received {int(total[0])} rows but recv_cap={cap}; the caller's receive bound is too small"
            )
        cached = self._dispatch_views.get(cap)
        if cached is not None and _same(cached[0], src):
            rows, result = cached[1]
        else:
            rows = out.view(cfg.dispatch_dtype) if self._fp4 and out.dtype == _BYTE else out
            result = (rows[:cap], out_w[:cap], None if out_s is None else out_s[:cap], out_i[:cap], total)
            self._dispatch_views[cap] = (src, (rows, result))
        self._sequence += 1
        self._last = {
            "sequence": self._sequence, "num_tokens": n, "weights": out_w if weights is not None else None,
            "indices": result[3], "total": total, "rows": rows, "all_indices": out_i, "packed_x": None,
        }
        if not return_routing:
            return result
        own = indices.clone() if clone_routing else indices
        engine = self._engine
        handle = EpDispatchRoutingHandle(
            own, self._empty, self._empty, total, None, n, sequence=self._sequence,
            reverse_map=engine.get_dispatch_src_token_pos,
        )
        return result + (handle,)

    def _scales_as_dwords(self, scales: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The caller's ``[n, scale_dim]`` scales as ``[n, dwords]`` int32 (padded when the row is
        not a whole number of dwords), or None."""
        cfg = self.cfg
        if scales is None or cfg.scale_dim == 0:
            return None if scales is None or scales.numel() == 0 else self._reject_scales(scales)
        if scales.dim() != 2 or scales.shape[1] != cfg.scale_dim or scales.element_size() != cfg.scale_type_size:
            raise ValueError(
                f"scales must be [num_tokens, scale_dim={cfg.scale_dim}] with {cfg.scale_type_size}-byte elements, "
                f"got {tuple(scales.shape)} {scales.dtype}"
            )
        raw = scales.contiguous().view(torch.uint8)
        nbytes = cfg.scale_dwords * 4
        if raw.shape[1] != nbytes:
            raw = torch.nn.functional.pad(raw, (0, nbytes - raw.shape[1]))
        return raw.view(torch.int32)

    def _reject_scales(self, scales: torch.Tensor) -> None:
        raise ValueError(f"scales has {scales.numel()} elements but cfg.scale_dim=0; pass None")

    # ------------------------------------------------------------------ combine
    def combine(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        indices: Optional[torch.Tensor] = None,
        *,
        routing: EpDispatchRoutingHandle,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return the expert outputs to their source ranks; per token, the fp32 sum over its ranks.

        Args:
            input: ``[rows, hidden]`` combine-dtype expert outputs in dispatch-output order
                (``combine_in_view()`` or a leading slice of it skips the copy in gather mode).
            weights: ``[rows, topk]`` float32 rows summed alongside; None = the weights dispatch
                delivered (MORI's v2 behaviour).
            indices: accepted for MORI's signature and not read (the handle has this rank's routing).
            routing: the handle of this op's latest dispatch.

        Returns:
            ``(out [num_tokens, hidden], out_weights [num_tokens, topk] f32 or None)``: views of the
            engine's output buffers, overwritten by the next combine.
        """
        last = self._require_last("combine()")
        if not isinstance(routing, EpDispatchRoutingHandle):
            raise TypeError(f"routing must be the EpDispatchRoutingHandle of the latest dispatch, got {type(routing)}")
        stale = routing.sequence not in (-1, last["sequence"]) or routing.cur_rank_num_token != last["num_tokens"]
        if stale:
            raise ValueError(
                f"routing belongs to dispatch #{routing.sequence} ({routing.cur_rank_num_token} tokens), but this op's "
                f"latest dispatch is #{last['sequence']} ({last['num_tokens']} tokens); combine follows its own dispatch"
            )
        cfg = self.cfg
        if input.dtype != cfg.combine_dtype or input.dim() != 2 or input.shape[1] != cfg.hidden_dim:
            raise ValueError(
                f"combine input must be [rows, hidden_dim={cfg.hidden_dim}] {cfg.combine_dtype}, "
                f"got {tuple(input.shape)} {input.dtype}"
            )
        w = weights if weights is not None else last["weights"]
        _, _, cb, cw = self._launch(last["num_tokens"])
        if self._push:
            rows = input if input.is_contiguous() else input.contiguous()
        else:
            rows = self.combine_in_view()
            if input.data_ptr() != rows.data_ptr():
                n = min(int(input.shape[0]), int(rows.shape[0]))
                rows[:n].copy_(input[:n])
        src = self._engine.combine(
            rows, w, routing.disp_dest_tok_id_map, block_num=cb, warp_per_block=cw,
            use_external_inp_buf=int(self._push),
        )
        n = last["num_tokens"]
        cached = self._combine_views.get(n)
        if cached is not None and _same(cached[0], src):
            return cached[1]
        out, out_w = src
        result = (out[:n], None if out_w is None else out_w[:n])
        self._combine_views[n] = (src, result)
        return result

    # ------------------------------------------------------------------ standard MoE
    def convert_dispatch_output(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The latest dispatch's rows in the per-expert layout: ``(packed_x [E_local, world * max_tokens,
        hidden], packed_count [E_local] int32, packed_src [E_local, world * max_tokens] int32)``."""
        self._require_std("convert_dispatch_output()")
        last = self._require_last("convert_dispatch_output()")
        x, count, src, _ = self._engine.convert_dispatch_output(last["rows"], last["all_indices"])
        last["packed_x"] = x
        return x, count, src

    def convert_combine_input(self, routing: EpDispatchRoutingHandle) -> torch.Tensor:
        """Sum each received token's expert rows of ``packed_x`` (weighted by its gating weights)
        into :meth:`combine_in_view`; pass that view to :meth:`combine`. Returns the view."""
        self._require_std("convert_combine_input()")
        last = self._require_last("convert_combine_input()")
        if last["packed_x"] is None:
            raise RuntimeError("convert_combine_input() needs convert_dispatch_output() of the same dispatch first")
        if routing.sequence not in (-1, last["sequence"]):
            raise ValueError(f"routing belongs to dispatch #{routing.sequence}, the latest is #{last['sequence']}")
        return self._engine.convert_combine_input(last["packed_x"])

    def _require_std(self, what: str) -> None:
        if not self.cfg.enable_std_moe:
            raise RuntimeError(f"{what} needs an op built with enable_std_moe=True")

    # ------------------------------------------------------------------ misc
    def reset(self) -> None:
        """Nothing to reset: the engine's kernels reset their counters themselves."""
        return None

    def close(self) -> None:
        """Return the engine's symmetric buffers (collective: every rank closes in the same order)."""
        if self._closed:
            return
        self._closed = True
        # drop the views of the engine's buffers so nothing here keeps them alive
        self._dispatch_views.clear()
        self._combine_views.clear()
        self._combine_in = None
        self._last = None
        close = getattr(self._engine, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "EpDispatchCombineOp":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
