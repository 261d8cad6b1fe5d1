"""One rank of the CPU numerics test: vLLM's modular kernel with mori_ep over gloo.

Run as ``python vllm_ep_worker.py --rank R --world-size N --port P --out result.json``.
The rank loads vLLM's general plugins the way vLLM does, initialises vLLM's distributed
state with data parallelism + expert parallelism and ``all2all_backend="mori_ep"`` (so the
EP group's communicator builds the all2all manager through the plugin's hook), then for
every case builds the prepare/finalize through an oracle's ``maybe_make_prepare_finalize``,
wraps it with reference experts in vLLM's ``FusedMoEKernel`` and compares the output with a
single-process MoE over the same tokens and weights. Results (per case: None or the error)
are written as JSON; the test process asserts on them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

CASES_ENV = "MORI_VLLM_TEST_CASES"  # optional comma-separated subset of case names


@dataclass
class Case:
    """One numerics scenario."""

    name: str
    tokens_per_rank: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    quant: str = "none"  # none | fp8_token | fp8_block | fp8_static | fp8_tensor_dynamic
    experts: str = "reduce_self"  # reduce_self | reduce_in_finalize | quantize_themselves | batched
    fp8_transport: bool = False
    topk: int = 3
    weight_on_input: bool = False
    hidden: int = 256
    extra: dict = field(default_factory=dict)


CASES = [
    Case("bf16_basic", (5, 9), dtype=torch.bfloat16),
    Case("zero_tokens_on_rank0", (0, 7)),
    Case("zero_tokens_everywhere", (0, 0)),
    Case("reduce_in_finalize", (6, 3), experts="reduce_in_finalize"),
    Case("fp8_transport_env", (4, 11), fp8_transport=True),
    Case("fp8_transport_env_bf16_zero", (0, 6), dtype=torch.bfloat16, fp8_transport=True),
    Case("fp8_per_token", (3, 8), quant="fp8_token"),
    Case("fp8_block_1x128", (7, 2), quant="fp8_block"),
    Case("fp8_static_per_tensor", (5, 5), quant="fp8_static"),
    Case("fp8_dynamic_per_tensor", (6, 4), quant="fp8_tensor_dynamic"),
    Case("fp8_deferred_to_experts", (4, 5), quant="fp8_token", experts="quantize_themselves", fp8_transport=True),
    Case("top1_weight_on_input", (4, 6), topk=1, weight_on_input=True),
    # Batched experts (BatchedExperts format): MORI's standard-MoE layout. Chosen the way vLLM
    # chooses batched experts: --moe-backend batched_triton, or VLLM_MORI_EP_BATCHED_EXPERTS=1.
    Case("batched_bf16", (5, 9), dtype=torch.bfloat16, experts="batched"),
    Case("batched_zero_tokens_env", (0, 7), experts="batched", extra={"via": "env"}),
    Case("batched_fp8_per_token", (3, 8), quant="fp8_token", experts="batched", extra={"via": "env"}),
    Case("batched_fp8_block_1x128", (7, 2), quant="fp8_block", experts="batched", extra={"via": "env"}),
    Case("batched_fp8_static_per_tensor", (5, 5), quant="fp8_static", experts="batched", extra={"via": "env"}),
    Case("batched_fp8_dynamic_per_tensor", (6, 4), quant="fp8_tensor_dynamic", experts="batched", extra={"via": "env"}),
    Case("batched_fp8_transport_env", (4, 11), fp8_transport=True, experts="batched"),
    Case("batched_top1_weight_on_input", (4, 6), topk=1, weight_on_input=True, experts="batched"),
]

NUM_EXPERTS = 8
INTERMEDIATE = 64
MAX_TOKENS = 32


def init_vllm(rank: int, world_size: int, port: int):  # noqa: ANN201 - returns vLLM's config
    """Load plugins like vLLM does and bring up DP x EP distributed state with mori_ep."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    parallel = ParallelConfig(
        data_parallel_size=world_size,
        data_parallel_rank=rank,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_master_port=port,
        enable_expert_parallel=True,
        all2all_backend="mori_ep",
    )
    # vLLM pre-picks random free ports per process; all ranks must rendezvous on ``port``.
    parallel._data_parallel_master_port_list = []
    parallel.data_parallel_master_port = port
    config = VllmConfig(parallel_config=parallel)
    ctx = set_current_vllm_config(config)
    ctx.__enter__()
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", timeout=datetime.timedelta(seconds=60)
    )
    initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return config


def quant_config_for(case: Case, problem_x: torch.Tensor):  # noqa: ANN201 - vLLM quant config
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, fp8_w8a8_moe_quant_config

    ones = torch.ones(NUM_EXPERTS)
    if case.quant == "none":
        return FUSED_MOE_UNQUANTIZED_CONFIG
    if case.quant == "fp8_token":
        return fp8_w8a8_moe_quant_config(ones, ones, per_act_token_quant=True)
    if case.quant == "fp8_block":
        return fp8_w8a8_moe_quant_config(ones, ones, block_shape=[128, 128])
    if case.quant == "fp8_static":
        return fp8_w8a8_moe_quant_config(ones, ones, a1_scale=static_scale(problem_x))
    if case.quant == "fp8_tensor_dynamic":
        return fp8_w8a8_moe_quant_config(ones, ones)
    raise ValueError(case.quant)


def static_scale(x: torch.Tensor) -> torch.Tensor:
    """A calibrated-looking static activation scale (same on every rank)."""
    from mori_integrations.vllm import quant

    return torch.tensor([float(x.abs().max()) / quant.fp8_max() * 0.9 + 1e-6], dtype=torch.float32)


def expected_output(case: Case, problem, rank: int, world_size: int) -> torch.Tensor:  # noqa: ANN001
    """Single-process MoE of this rank's tokens, with what each expert really sees.

    Two FP8 round trips can touch a token: FP8 *transport* (env flag; only when the tokens
    travel unquantised) and the quant config's scheme (applied by prepare or the experts).
    """
    from mori_integrations.vllm import quant
    from vllm_ep_reference import reference_moe

    x, ids, w = problem.x, problem.topk_ids, problem.topk_weights
    per_rank = NUM_EXPERTS // world_size
    travels_unquantised = case.quant in ("none", "fp8_tensor_dynamic") or case.experts == "quantize_themselves"
    transport_groups = case.hidden // 128 if case.quant == "fp8_block" else 1

    def transport(rows: torch.Tensor) -> torch.Tensor:
        if case.fp8_transport and travels_unquantised:
            return quant.quantize_dequantize_rows(rows, transport_groups)
        return rows

    scheme: Callable[[torch.Tensor, int], torch.Tensor]
    if case.quant == "none":
        scheme = lambda rows, e: rows  # noqa: E731
    elif case.quant == "fp8_token":
        scheme = lambda rows, e: quant.quantize_dequantize_rows(rows, 1)  # noqa: E731
    elif case.quant == "fp8_block":
        scheme = lambda rows, e: quant.quantize_dequantize_rows(rows, case.hidden // 128)  # noqa: E731
    elif case.quant == "fp8_static":
        s = static_scale(x)
        scheme = lambda rows, e: quant.dequantize_rows(quant.quantize_static(rows, s), s, rows.dtype)  # noqa: E731
    else:  # fp8_tensor_dynamic: each rank quantises all it received with one scale of its own
        xin = x.to(torch.float32) * (w if case.weight_on_input else 1.0)
        arrived = transport(xin.to(x.dtype)).to(torch.float32)
        scales = []
        for d in range(world_size):
            dest = (ids.to(torch.int64) // per_rank == d).any(dim=1)
            amax = float(arrived[dest].abs().max()) if dest.any() else 0.0
            scales.append(torch.tensor([max(amax / quant.fp8_max(), 1e-10)]))
        scheme = lambda rows, e: quant.dequantize_rows(  # noqa: E731
            quant.quantize_static(rows, scales[e // per_rank]), scales[e // per_rank], rows.dtype
        )

    full = reference_moe(
        x, ids, w, problem.w13, problem.w2, lambda rows, e: scheme(transport(rows), e), case.weight_on_input
    )
    return full[problem.rank_slice(rank)]


def run_case(case: Case, rank: int, world_size: int, config) -> Optional[str]:  # noqa: ANN001
    """Run one case; return None on success or a description of the mismatch/failure."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    import vllm.model_executor.layers.fused_moe.oracle.unquantized as unquantized_oracle
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    from mori_integrations.vllm.prepare_finalize import MoriPrepareAndFinalize
    from vllm_ep_experts import (
        TorchBatchedExperts,
        TorchExperts,
        TorchExpertsQuantizingThemselves,
        TorchExpertsReducedInFinalize,
    )
    from vllm_ep_reference import make_problem

    os.environ["VLLM_MORI_EP_USE_FP8_DISPATCH"] = "1" if case.fp8_transport else "0"
    batched = case.experts == "batched"
    via_env = batched and case.extra.get("via") == "env"
    os.environ["VLLM_MORI_EP_BATCHED_EXPERTS"] = "1" if via_env else "0"
    problem = make_problem(
        seed=1234 + len(case.name),
        tokens_per_rank=case.tokens_per_rank,
        hidden=case.hidden,
        intermediate=INTERMEDIATE,
        num_experts=NUM_EXPERTS,
        topk=case.topk,
        dtype=case.dtype,
    )
    parallel = FusedMoEParallelConfig.make(
        tp_size_=1, pcp_size_=1, dp_size_=world_size, sp_size_=1, vllm_parallel_config=config.parallel_config
    )
    assert parallel.use_all2all_kernels and parallel.ep_rank == rank, parallel
    # the plugin's hook asks the oracles for batched experts only when VLLM_MORI_EP_BATCHED_EXPERTS=1
    assert parallel.use_batched_activation_format == via_env, parallel.use_batched_activation_format
    per_rank = NUM_EXPERTS // world_size
    moe = FusedMoEConfig(
        num_experts=NUM_EXPERTS,
        experts_per_token=case.topk,
        hidden_dim=case.hidden,
        intermediate_size=INTERMEDIATE,
        num_local_experts=per_rank,
        num_logical_experts=NUM_EXPERTS,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel,
        in_dtype=case.dtype,
        max_num_tokens=MAX_TOKENS,
        moe_backend="batched_triton" if batched and not via_env else "auto",
    )
    quant_config = quant_config_for(case, problem.x)
    # The oracle module's own binding: proves the plugin rebound what the oracles call.
    pf = unquantized_oracle.maybe_make_prepare_finalize(moe=moe, quant_config=quant_config, allow_new_interface=True)
    assert isinstance(pf, MoriPrepareAndFinalize), f"got {type(pf).__name__}"
    want_format = mk.FusedMoEActivationFormat.BatchedExperts if batched else mk.FusedMoEActivationFormat.Standard
    assert pf.activation_format == want_format, f"prepare/finalize format {pf.activation_format}, expected {want_format}"
    if batched:  # as vLLM's oracles build batched experts
        fused_experts = TorchBatchedExperts(
            moe_config=moe, quant_config=quant_config, max_num_tokens=pf.max_num_tokens_per_rank(),
            num_dispatchers=pf.num_dispatchers(),
        )
    else:
        experts_cls = {
            "reduce_self": TorchExperts,
            "reduce_in_finalize": TorchExpertsReducedInFinalize,
            "quantize_themselves": TorchExpertsQuantizingThemselves,
        }[case.experts]
        fused_experts = experts_cls(moe_config=moe, quant_config=quant_config)
    kernel = mk.FusedMoEKernel(pf, fused_experts)
    assert kernel.output_is_reduced()

    experts = problem.local_experts(rank, world_size)
    expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    expert_map[experts] = torch.arange(per_rank, dtype=torch.int32)
    mine = problem.rank_slice(rank)
    # Run twice: the second round checks that state (ops, pre-dispatch ids) resets correctly.
    for _ in range(2):
        out = kernel.apply(
            hidden_states=problem.x[mine].clone(),
            w1=problem.w13[experts],
            w2=problem.w2[experts],
            topk_weights=problem.topk_weights[mine].clone(),
            topk_ids=problem.topk_ids[mine].clone(),
            activation=MoEActivation.SILU,
            global_num_experts=NUM_EXPERTS,
            expert_map=expert_map,
            apply_router_weight_on_input=case.weight_on_input,
        )
    expected = expected_output(case, problem, rank, world_size)
    if tuple(out.shape) != tuple(expected.shape):
        return f"shape {tuple(out.shape)} != expected {tuple(expected.shape)}"
    if case.dtype == torch.bfloat16:
        atol, rtol = 2e-2, 2e-2
    else:
        atol, rtol = 1e-5, 1e-5
    try:
        want = expected.to(case.dtype).to(torch.float32)
        torch.testing.assert_close(out.to(torch.float32), want, atol=atol, rtol=rtol)
    except AssertionError as e:
        return f"output differs from the single-process MoE: {e}"
    return None


def main() -> int:
    """Entry point: run every (selected) case and write the per-case results."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result: dict = {"setup": None, "cases": {}, "manager": None}
    try:
        torch.manual_seed(0)
        config = init_vllm(args.rank, args.world_size, args.port)
        from vllm.distributed.parallel_state import get_ep_group

        manager = get_ep_group().device_communicator.all2all_manager
        result["manager"] = f"{type(manager).__module__}.{type(manager).__name__}"
        selected = [c for c in os.environ.get(CASES_ENV, "").split(",") if c]
        for case in CASES:
            if selected and case.name not in selected:
                continue
            try:
                result["cases"][case.name] = run_case(case, args.rank, args.world_size, config)
            except Exception:
                result["cases"][case.name] = traceback.format_exc()
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        result["manager_destroyed"] = manager._shmem_group is None and not manager._ops
    except Exception:
        result["setup"] = traceback.format_exc()
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
