"""One rank of the MoE EP test: stock SGLang's MORI dispatcher over a real gloo group.

Each rank loads the plugins, joins a gloo world, builds SGLang's own tp GroupCoordinator
(``init_model_parallel_group``) and records the EP layout in SGLang's ParallelContext, sets
``--moe-a2a-backend mori`` in SGLang's MoE flags, and builds the dispatcher with SGLang's
``create_moe_dispatcher`` (-> ``MaybeTboDeepEPDispatcher`` -> ``MoriEPDispatcher``). Then, per
case: ``set_quant_config`` (as SGLang's quant methods do), ``dispatch``, a per-expert linear on
the received rows, ``combine``, and a comparison with a dense single-process MoE that the rank
computes itself for its own tokens (every rank can rebuild all inputs from the seed).

What stands in for the GPU on this CPU machine (and nothing else):
* EPv2: mori-suite's ``mori.cco.Communicator`` has no GPU here, so EPv2 ops run mori_core's
  reference engine over the gloo group (product behaviour, no substitution).
* EPv1: stock code calls ``mori.shmem.shmem_torch_process_group_init`` and
  ``mori.ops.EpDispatchCombineOp(cfg)`` (the GPU kernels); the test routes them to mori_core's
  reference engine over the registered "mori" group.
* moriep.py puts its expert mask on ``torch.cuda.current_device()``, reads the CU count from
  ``torch.cuda.get_device_properties`` and asks the device module whether a graph is being
  captured; those three point at the CPU.
"""

from __future__ import annotations

import faulthandler
import os
import traceback
from types import SimpleNamespace
from typing import Any

import torch

HIDDEN = 256
TOPK = 3
EXPERTS_PER_RANK = 4
TOKENS = 24  # per rank
MAX_TOKENS = 32  # SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK
FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- inputs and oracle
def rank_inputs(rank: int, world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden bf16 [T, H], topk_ids int32 [T, K] (distinct), topk_weights f32 [T, K])`` of ``rank``."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    experts = EXPERTS_PER_RANK * world
    x = (torch.randn(TOKENS, HIDDEN, generator=g) * 2).to(torch.bfloat16)
    ids = torch.rand(TOKENS, experts, generator=g).topk(TOPK, dim=1).indices.to(torch.int32)
    ids[0, 1] = -1  # a dropped slot (SGLang marks padded/masked experts with -1)
    w = torch.rand(TOKENS, TOPK, generator=g)
    return x, ids, w


def expert_weights(world: int, seed: int) -> torch.Tensor:
    """fp32 ``[E, H, H]`` expert matrices (every rank builds the same)."""
    g = torch.Generator().manual_seed(seed * 7 + 1)
    return torch.randn(EXPERTS_PER_RANK * world, HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """The oracle's own FP8 blockwise quantise-dequantise (128 channels, amax / 448)."""
    b = x.float().view(x.shape[0], -1, 128)
    s = b.abs().amax(-1, keepdim=True) / 448.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return ((b / s).clamp(-448, 448).to(FP8).float() * s).view(x.shape)


def dense_moe(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * x[t] @ W[ids[t, k]]`` in fp32 (dropped ids skipped)."""
    out = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= 0:
                out[t] += w[t, k] * (x[t].float() @ W[e])
    return out


def run_experts(dispatched: Any, W: torch.Tensor, rank: int, fp8: bool) -> torch.Tensor:
    """What an EP MoE layer computes on the received rows: for each of its local experts, the
    weighted linear of the (dequantised) token; one bf16 row per received token."""
    n = int(dispatched.num_recv_tokens_per_expert[0])
    x = dispatched.hidden_states[:n].float()
    if fp8:
        s = dispatched.hidden_states_scale[:n].float()
        x = (x.view(n, -1, 128) * s.view(n, -1, 1)).view(n, HIDDEN)
    ids = dispatched.topk_ids[:n].long()
    w = dispatched.topk_weights[:n].float()
    lo = rank * EXPERTS_PER_RANK
    y = torch.zeros(dispatched.hidden_states.shape[0], HIDDEN)
    for k in range(ids.shape[1]):
        e = ids[:, k]
        local = (e >= lo) & (e < lo + EXPERTS_PER_RANK)
        for r in torch.nonzero(local).flatten().tolist():
            y[r] += w[r, k] * (x[r] @ W[int(e[r])])
    return y.to(torch.bfloat16)


# ----------------------------------------------------------------------------- SGLang setup
def _cpu_device_shims() -> None:
    torch.cuda.current_device = lambda: "cpu"  # moriep.py: expert mask device
    torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(multi_processor_count=132)
    torch.cpu.is_current_stream_capturing = lambda: False  # moriep.py asks whether a graph is being
    torch.cuda.is_current_stream_capturing = lambda: False  # captured; CPU has no graphs


def _route_v1_engine_to_reference(ep_group: Any) -> None:
    import mori
    from mori_core.ops import ReferenceEpDispatchCombineOp

    mori.shmem.shmem_torch_process_group_init = lambda name: 0
    mori.ops.EpDispatchCombineOp = lambda cfg: ReferenceEpDispatchCombineOp(cfg, group=ep_group)


# Every gloo collective fails after this long instead of torch's 30 minutes (a rank that missed one).
COLLECTIVE_TIMEOUT_S = 150


def setup_sglang(rank: int, world: int, init_method: str) -> Any:
    """Plugins, gloo world, SGLang's tp GroupCoordinator and MoE flags; returns the group."""
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what every SGLang process does first: mori-suite readies moriep.py
    from sglang.srt.distributed.parallel_state import init_distributed_environment, init_model_parallel_group
    from sglang.srt.layers.moe.utils import DeepEPMode, MoeA2ABackend
    from sglang.srt.runtime_context import get_flags, get_parallel

    init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=init_method, local_rank=rank, backend="gloo",
        timeout=COLLECTIVE_TIMEOUT_S,
    )
    tp = init_model_parallel_group(
        [list(range(world))], rank, "gloo", use_pynccl=False, use_custom_allreduce=False, group_name="tp",
        use_mscclpp=False, use_torch_symm_mem_allreduce=False,
    )
    get_parallel().override_permanently(
        tp_size=world, tp_rank=rank, tp_group=tp, moe_ep_size=world, moe_ep_rank=rank, moe_ep_group=tp,
        attn_tp_size=world, attn_tp_rank=rank, pp_size=1, pp_rank=0, attn_dp_size=1, attn_dp_rank=0,
        attn_cp_size=1, attn_cp_rank=0, moe_dp_size=1, attn_dcp_size=1, shared_experts_tp_size=None,
    )
    moe = get_flags().moe
    moe.a2a_backend = MoeA2ABackend("mori")
    moe.deepep_mode = DeepEPMode("auto")
    moe.tbo_enabled = False
    return tp


def build_dispatcher(world: int) -> Any:
    """SGLang's own construction path for ``--moe-a2a-backend mori``."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import create_moe_dispatcher
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    cfg = MoeRunnerConfig(
        num_experts=EXPERTS_PER_RANK * world, num_local_experts=EXPERTS_PER_RANK, hidden_size=HIDDEN,
        intermediate_size_per_partition=HIDDEN, layer_id=0, top_k=TOPK, num_fused_shared_experts=0,
        params_dtype=torch.bfloat16,
    )
    return create_moe_dispatcher(cfg, quant_method=None)


# ----------------------------------------------------------------------------- one case
def run_case(dispatcher: Any, rank: int, world: int, seed: int, weight_dtype: torch.dtype) -> dict:
    """set_quant_config -> dispatch -> experts -> combine; compares with the dense MoE."""
    from sglang.srt.layers.moe.token_dispatcher.moriep import MoriEPLLCombineInput, MoriEPNormalCombineInput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    dispatcher.set_quant_config({"weight_dtype": weight_dtype})
    inner = dispatcher._inners[0]._get_impl()
    fp8 = inner.dispatch_dtype.name == "fp8"
    x, ids, w = rank_inputs(rank, world, seed)
    W = expert_weights(world, seed)
    topk = StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=torch.empty(0))
    out_disp = dispatcher.dispatch(hidden_states=x, topk_output=topk)
    received = int(out_disp.num_recv_tokens_per_expert[0])
    y = run_experts(out_disp, W, rank, fp8)
    # As SGLang's MORI expert runner builds it (moe_runner/aiter.py): this rank's own routing.
    comb_cls = MoriEPNormalCombineInput if type(out_disp).__name__.endswith("NormalDispatchOutput") else MoriEPLLCombineInput
    comb = comb_cls(hidden_states=y, topk_ids=out_disp.origin_topk_ids, topk_weights=out_disp.origin_topk_weights)
    out = dispatcher.combine(combine_input=comb)
    ref = dense_moe(fp8_roundtrip(x) if fp8 else x, ids, w, W)
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    return {
        "dispatch_dtype": inner.dispatch_dtype.name, "combine_dtype": inner.combine_dtype.name,
        "output": type(out_disp).__name__, "op": type(inner.mori_op).__module__ + "." + type(inner.mori_op).__name__,
        "backend": getattr(inner.mori_op, "backend_name", "v1"), "received": received,
        "kernel_type": str(getattr(getattr(inner.mori_op, "config", None), "kernel_type", "-")),
        "out_shape": list(out.shape), "out_dtype": str(out.dtype), "max_err": err, "ref_max": scale,
        "scales_shape": None if out_disp.hidden_states_scale is None else list(out_disp.hidden_states_scale.shape),
    }


# name -> weight dtype SGLang's quant method reports, env overrides, --deepep-mode
CASES = {
    "bf16": dict(weight=torch.bfloat16, env={}, mode="auto"),
    "fp8": dict(weight=FP8, env={}, mode="auto"),
    "fp8_combine": dict(weight=torch.bfloat16, env={"SGLANG_MORI_COMBINE_DTYPE": "fp8"}, mode="auto"),
    "bf16_normal": dict(weight=torch.bfloat16, env={}, mode="normal"),
    "fp8_normal": dict(weight=FP8, env={}, mode="normal"),
    "fp8_combine_normal": dict(weight=torch.bfloat16, env={"SGLANG_MORI_COMBINE_DTYPE": "fp8"}, mode="normal"),
    "bf16_low_latency": dict(weight=torch.bfloat16, env={}, mode="low_latency"),
}


# A rank still running after this long prints every thread's stack to stderr (once), so that a
# hang shows where it waits before test_moe_ep gives up on the rank (RESULT_TIMEOUT_S).
STACKS_AFTER_S = 200


def rank_main(rank: int, world: int, init_method: str, path: str, cases: list, seed: int, results: Any) -> None:
    """Process entry: one EP path ("v1" or "v2"), every case in ``cases``, the gloo world met through
    ``init_method``; puts (rank, dict, error)."""
    faulthandler.dump_traceback_later(STACKS_AFTER_S, repeat=False)
    out: dict = {}
    try:
        os.environ["SGLANG_MORI_EP_V2"] = "true" if path == "v2" else "false"
        os.environ["SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_TOKENS)
        _cpu_device_shims()
        tp = setup_sglang(rank, world, init_method)
        if path == "v1":
            _route_v1_engine_to_reference(tp.cpu_group)
        for name in cases:
            case = CASES[name]
            for k in ("SGLANG_MORI_COMBINE_DTYPE",):
                os.environ.pop(k, None)
            os.environ.update(case["env"])
            from sglang.srt.layers.moe.utils import DeepEPMode
            from sglang.srt.runtime_context import get_flags

            get_flags().moe.deepep_mode = DeepEPMode(case["mode"])
            dispatcher = build_dispatcher(world)
            out[name] = run_case(dispatcher, rank, world, seed, case["weight"])
        results.put((rank, out, None))
    except BaseException:
        results.put((rank, out, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
