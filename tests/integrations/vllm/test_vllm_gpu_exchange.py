"""GPU check of the vLLM adapter's dispatch/combine logic over the core GPU operator.

vLLM is not installed on the GPU machine, so this test drives the vLLM-free part of the
prepare/finalize -- :class:`~mori_integrations.vllm.token_exchange.MoriEpTokenExchange`
(dispatch with optional FP8 transport, valid-row slicing, finalize-side weight-and-reduce,
combine with the pre-dispatch ids) built by :func:`~mori_integrations.vllm.mori_utils.create_mori_ep_op`
-- over ``mori_core``'s ``EpDispatchCombineOp`` at EP1 (every token local), EP2, EP4 and EP8 (ranks
placed by ``MORI_RANKS_PER_GPU``: they share GPUs where there are fewer GPUs than ranks), with torch
experts standing in for vLLM's, and compares every rank's output with a single-process MoE.
It imports nothing from vLLM. Run by ``tools/gpu/vllm.sh``.
"""

from __future__ import annotations

import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TIMEOUT_S = 300

# (name, tokens per rank (cycled over ranks), dtype, mode)
#   mode: "plain" | "fp8_transport" | "fp8_before_dispatch" | "reduce_in_finalize", each optionally
#   prefixed "batched_" (batched experts: MORI's standard-MoE layout, dispatch_batched/combine_batched)
GPU_CASES = [
    ("bf16_ragged_with_empty_rank", (0, 37, 5, 64), torch.bfloat16, "plain"),
    ("fp32_ragged", (13, 1, 29, 8), torch.float32, "plain"),
    ("bf16_fp8_transport", (24, 0, 17, 40), torch.bfloat16, "fp8_transport"),
    ("bf16_fp8_per_token_before_dispatch", (9, 31, 0, 12), torch.bfloat16, "fp8_before_dispatch"),
    ("fp32_reduce_in_finalize", (21, 6, 0, 33), torch.float32, "reduce_in_finalize"),
    ("no_tokens_anywhere", (0, 0, 0, 0), torch.bfloat16, "plain"),
    ("batched_bf16_ragged", (0, 37, 5, 64), torch.bfloat16, "batched_plain"),
    ("batched_fp32", (13, 1, 29, 8), torch.float32, "batched_plain"),
    ("batched_bf16_fp8_transport", (24, 0, 17, 40), torch.bfloat16, "batched_fp8_transport"),
    ("batched_bf16_fp8_per_token_before_dispatch", (9, 31, 0, 12), torch.bfloat16, "batched_fp8_before_dispatch"),
]
HIDDEN, INTER, EXPERTS_PER_RANK, TOPK, MAX_TOKENS = 256, 128, 4, 3, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    from vllm_ep_reference import expert_ffn

    return expert_ffn(x, w13, w2)


def _experts(received: Any, exchange: Any, w13: torch.Tensor, w2: torch.Tensor, reduce_here: bool) -> torch.Tensor:
    """What a vLLM Standard-format expert does with the received rows (local experts only)."""
    r, k = received.topk_ids.shape
    x = received.hidden_states
    if received.scales is not None:
        from mori_integrations.vllm import quant

        x = quant.dequantize_rows(x, received.scales, torch.float32)
    local = exchange.local_expert_mask(received.topk_ids)
    first = exchange.rank * exchange.num_local_experts
    per_slot = torch.full((r, k, HIDDEN), float("nan"), device=x.device)
    for slot in range(k):
        ids = received.topk_ids[:, slot].to(torch.int64) - first
        for e in torch.unique(ids[local[:, slot]]).tolist():
            rows = torch.nonzero((ids == e) & local[:, slot], as_tuple=True)[0]
            per_slot[rows, slot] = _local_ffn(x[rows], w13[e], w2[e])
    out_dtype = torch.float32 if received.hidden_states.dtype.itemsize == 1 else received.hidden_states.dtype
    if not reduce_here:  # finalize reduces (Delegate): hand over [R, k, H] with NaN in other ranks' slots
        return exchange.weight_and_reduce(per_slot.to(out_dtype), received)
    w = torch.where(local, received.topk_weights, torch.zeros_like(received.topk_weights))
    summed = torch.where(local.unsqueeze(-1), per_slot * w.unsqueeze(-1), torch.zeros((), device=x.device)).sum(1)
    return summed.to(out_dtype)


def _batched_experts(received: Any, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """What a vLLM BatchedExperts-format expert does: per local expert, its valid rows only
    (rows past the counts stay NaN, so a combine that reads them fails)."""
    x = received.hidden_states
    counts = received.expert_num_tokens.tolist()
    out_dtype = torch.float32 if x.dtype.itemsize == 1 else x.dtype
    y = torch.full(x.shape, float("nan"), dtype=out_dtype, device=x.device)
    for e, n in enumerate(counts):
        if n:
            rows = x[e, :n]
            if received.scales is not None:
                from mori_integrations.vllm import quant

                rows = quant.dequantize_rows(rows, received.scales[e, :n], torch.float32)
            y[e, :n] = _local_ffn(rows, w13[e], w2[e]).to(out_dtype)
    return y


def _rank(rank: int, world: int, port: int, device_type: str, q: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from mori_integrations.vllm import quant
        from mori_integrations.vllm.mori_utils import MoriEpConfig, create_mori_ep_op
        from mori_integrations.vllm.token_exchange import MoriEpTokenExchange
        from vllm_ep_reference import make_problem, reference_moe

        shmem = None
        if device_type == "cuda":
            import mori_core.shmem as shmem

            from mori_core.placement import placement

            device = torch.device("cuda", placement(world).device_index(rank))
            torch.cuda.set_device(device)
            # As MoriEpAll2AllManager does with vLLM's EP cpu_group.
            torch._C._distributed_c10d._register_process_group("vllm_gpu_check", dist.group.WORLD)
            shmem.shmem_torch_process_group_init("vllm_gpu_check")
            expected_op = "EpDispatchCombineOp"
        else:  # dry run of this test's own logic with the reference operator
            device = torch.device("cpu")
            expected_op = "ReferenceEpDispatchCombineOp"
        failures: dict[str, Optional[str]] = {}
        ops = []
        for name, tokens, dtype, mode in GPU_CASES:
            try:
                tpr = [tokens[r % len(tokens)] for r in range(world)]
                problem = make_problem(
                    7 + len(name), tpr, HIDDEN, INTER, EXPERTS_PER_RANK * world, TOPK, dtype, device=device
                )
                batched = mode.startswith("batched_")
                mode = mode.removeprefix("batched_")
                fp8 = mode in ("fp8_transport", "fp8_before_dispatch")
                cfg = MoriEpConfig(
                    rank=rank,
                    world_size=world,
                    hidden_dim=HIDDEN,
                    dispatch_dtype=quant.FP8_DTYPE if mode == "fp8_before_dispatch" else dtype,
                    activation_dtype=dtype,
                    scale_dim=1 if fp8 else 0,
                    max_num_tokens_per_rank=MAX_TOKENS,
                    num_local_experts=EXPERTS_PER_RANK,
                    num_experts_per_token=TOPK,
                )
                op = create_mori_ep_op(cfg, device)
                ops.append(op)
                assert type(op).__name__ == expected_op, type(op)
                exchange = MoriEpTokenExchange(
                    op, rank, EXPERTS_PER_RANK, transport_fp8=mode == "fp8_transport", transport_groups=1
                )
                mine = problem.rank_slice(rank)
                experts = problem.local_experts(rank, world)
                w13, w2 = problem.w13[experts], problem.w2[experts]
                for _ in range(2):  # back-to-back rounds on the same operator
                    x = problem.x[mine]
                    if batched:
                        scales = None
                        if mode == "fp8_before_dispatch":
                            x, scales = quant.quantize_rows(x, 1)
                        got = exchange.dispatch_batched(x, problem.topk_weights[mine], problem.topk_ids[mine], scales)
                        out = exchange.combine_batched(_batched_experts(got, w13, w2).to(dtype))
                        continue
                    if mode == "fp8_before_dispatch":
                        xq, s = quant.quantize_rows(x, 1)
                        received = exchange.dispatch(xq, problem.topk_weights[mine], problem.topk_ids[mine], s)
                    else:
                        received = exchange.dispatch(x, problem.topk_weights[mine], problem.topk_ids[mine])
                    rows = _experts(received, exchange, w13, w2, reduce_here=mode != "reduce_in_finalize")
                    out = exchange.combine(rows.to(dtype))
                transform = None
                if fp8:
                    transform = lambda rows, e: quant.quantize_dequantize_rows(rows, 1)  # noqa: E731
                expected = reference_moe(
                    problem.x, problem.topk_ids, problem.topk_weights, problem.w13, problem.w2, transform
                )[mine]
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                torch.testing.assert_close(out.float(), expected.to(dtype).float(), atol=tol, rtol=tol)
                failures[name] = None
            except Exception:
                failures[name] = traceback.format_exc()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, failures)
        for op in ops:  # GPU operators: collective, same order on every rank
            if hasattr(op, "close"):
                op.close()
        if shmem is not None:
            shmem.shmem_finalize()
        dist.destroy_process_group()
        if rank == 0:
            q.put(("ok", gathered))
    except BaseException:
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _run(world: int, device_type: str) -> list[dict]:
    """Every rank's case failures (rank 0 gathers them); raises with a rank's traceback or on a hang."""
    from mori_core.bench.spawned import first_result

    port = _free_port()
    return first_result([(_rank, (r, world, port, device_type)) for r in range(world)], TIMEOUT_S)


def _assert_all_passed(per_rank: list[dict]) -> None:
    problems = [
        f"rank {r} / {case}:\n{err}" for r, res in enumerate(per_rank) for case, err in res.items() if err is not None
    ]
    assert not problems, "\n".join(problems)
    assert all(len(res) == len(GPU_CASES) for res in per_rank)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_token_exchange_over_gpu_op_matches_single_process_moe(world: int) -> None:
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU (ranks share it when there are fewer GPUs than ranks)")
    from mori_core.ops import gpu_ops_available

    ok, why = gpu_ops_available()
    if not ok:
        pytest.skip(why)
    _assert_all_passed(_run(world, "cuda"))


def test_token_exchange_over_reference_op_matches_single_process_moe() -> None:
    """The same cases on CPU over the reference operator (gloo): checks this file's logic
    everywhere, and the exchange without vLLM."""
    _assert_all_passed(_run(2, "cpu"))
