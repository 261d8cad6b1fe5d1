"""Multi-process helpers for the EP tests: spawn N ranks, run a function, collect failures.

GPU ranks are placed by :mod:`mori_core.placement` (``MORI_RANKS_PER_GPU=auto|N``): one rank per
GPU where there are enough GPUs, otherwise several ranks share a GPU (separate processes, CUDA IPC
to the same device, gloo instead of NCCL), so EP2/EP4/EP8 run their cross-rank logic on a
one-GPU machine too. Every run is bounded: a rank that hangs is killed after ``timeout`` seconds and the test fails
with the ranks' tracebacks. Data generation is deterministic per (seed, rank), so every rank
can rebuild every other rank's inputs for the oracle without communicating. Also the pieces the
EP tests share: every rank's inputs, one-rank configs, combine inputs, CUDA-graph capture
and replay in a rank.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

import torch
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from mori_core.ops import EpDispatchCombineConfig

T = TypeVar("T")


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, backend: str, kwargs: dict, results: Any) -> None:
    import torch.distributed as dist

    stacks_after = float(os.environ.get("MORI_TEST_STACKS_AFTER_S", "0"))
    if stacks_after > 0:  # debugging a hang: each rank prints every thread's stack once, then goes on
        import faulthandler

        faulthandler.dump_traceback_later(stacks_after, repeat=False)
    try:
        if backend == "nccl":  # NCCL when every rank has its own GPU, gloo when they share
            from mori_core.placement import init_rank_process_group

            init_rank_process_group(rank, world_size, f"tcp://127.0.0.1:{port}")
        elif backend == "gloo":
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        fn(rank, world_size, **kwargs)
        results.put((rank, None))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    fn: Callable,
    world_size: int,
    backend: Optional[str] = "gloo",
    timeout: float = 120.0,
    env: Optional[dict] = None,
    **kwargs: Any,
) -> None:
    """Run ``fn(rank, world_size, **kwargs)`` in ``world_size`` spawned processes.

    ``backend``: "gloo" (CPU), "nccl" (GPU ranks placed by ``MORI_RANKS_PER_GPU``: NCCL plus gloo
    for CPU tensors with one GPU per rank, gloo alone when ranks share a GPU) or None (no process
    group). A ``MORI_SHMEM_HEAP_SIZE`` in ``env`` is scaled down when ranks share a GPU.
    Raises AssertionError with every failing rank's traceback.
    """
    if backend == "nccl" and env and "MORI_SHMEM_HEAP_SIZE" in env:
        from mori_core.placement import placement

        env = dict(env, MORI_SHMEM_HEAP_SIZE=placement(world_size).heap_size(env["MORI_SHMEM_HEAP_SIZE"]))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    old_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [
            ctx.Process(target=_worker, args=(r, fn, world_size, port, backend, kwargs, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    failures: dict[int, str] = {}
    done: set[int] = set()
    import time

    deadline = time.monotonic() + timeout
    while len(done) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, err = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        done.add(rank)
        if err is not None:
            failures[rank] = err
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    missing = sorted(set(range(world_size)) - done)
    if missing:
        failures.update({r: f"rank {r} did not finish within {timeout:.0f} s (or crashed)" for r in missing})
    if failures:
        msg = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n{msg}")


def make_routing(
    num_tokens: int,
    num_experts: int,
    topk: int,
    generator: torch.Generator,
    drop_prob: float = 0.0,
    out_of_range_prob: float = 0.0,
) -> torch.Tensor:
    """[num_tokens, topk] int32 distinct random experts per token, some replaced by -1 or by
    out-of-range ids (>= num_experts) to exercise the dropping rules."""
    if num_tokens == 0:
        return torch.zeros(0, topk, dtype=torch.int32)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    idx = scores.topk(topk, dim=1).indices.to(torch.int32)
    if drop_prob > 0:
        drop = torch.rand(num_tokens, topk, generator=generator) < drop_prob
        idx[drop] = -1
    if out_of_range_prob > 0:
        oor = torch.rand(num_tokens, topk, generator=generator) < out_of_range_prob
        idx[oor] = num_experts + 3
    return idx


def rank_inputs(
    seed: int,
    rank: int,
    num_tokens: int,
    hidden: int,
    num_experts: int,
    topk: int,
    dtype: torch.dtype,
    scale_dim: int = 0,
    drop_prob: float = 0.1,
    out_of_range_prob: float = 0.02,
) -> dict[str, torch.Tensor]:
    """Deterministic CPU inputs of one rank: x, weights, scales (float32 or None), indices."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(num_tokens, hidden, generator=g)
    if dtype.is_floating_point and torch.empty(0, dtype=dtype).element_size() == 1:
        x = x.clamp(-8, 8)
    return {
        "x": x.to(dtype),
        "weights": torch.rand(num_tokens, topk, generator=g),
        "scales": torch.rand(num_tokens, scale_dim, generator=g) if scale_dim > 0 else None,
        "indices": make_routing(num_tokens, num_experts, topk, g, drop_prob, out_of_range_prob),
    }


def all_rank_inputs(
    seed: int,
    world: int,
    counts: list[int],
    hidden: int,
    num_experts: int,
    topk: int,
    dtype: torch.dtype,
    scale_dim: int,
    device: torch.device,
    min_weight: float = 0.0,
    repeat_expert: bool = False,
) -> list[dict[str, Optional[torch.Tensor]]]:
    """Every rank's inputs on ``device``, the same on every rank (rank r draws from seed
    ``seed * 100 + r``), so each rank can check what it receives from every other one.

    Per rank, ``counts[r]`` tokens: "x" (clamped to [-6, 6] for 1-byte dtypes, which cannot
    hold more), "w" gating weights uniform in ``[min_weight, min_weight + 1)``, "s" scales
    (None without ``scale_dim``) and "idx" top-k ids (5 % dropped, 1 % out of range).
    ``repeat_expert``: every fourth token lists its first expert again in its last slot.
    """
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 100 + r)
        n = counts[r]
        x = torch.randn(n, hidden, generator=g)
        if dtype.itemsize == 1:
            x = x.clamp(-6, 6)
        idx = make_routing(n, num_experts, topk, g, drop_prob=0.05, out_of_range_prob=0.01)
        if repeat_expert and topk > 1:
            for t in range(0, n, 4):
                if idx[t, 0] >= 0:
                    idx[t, topk - 1] = idx[t, 0]
        w = torch.rand(n, topk, generator=g)
        if min_weight:  # no addition at 0: the weights stay bit-identical to the plain draw
            w = min_weight + w
        out.append(
            {
                "x": x.to(dtype).to(device),
                "w": w.to(device),
                "s": torch.rand(n, scale_dim, generator=g).to(device) if scale_dim else None,
                "idx": idx.to(device),
            }
        )
    return out


def single_rank_config(**fields: Any) -> EpDispatchCombineConfig:
    """An ``EpDispatchCombineConfig`` of one rank: bf16, hidden 128, no scales, 8 tokens, 4
    experts, top-2. ``fields`` replace any of these or set other config fields."""
    from mori_core.ops import EpDispatchCombineConfig

    base: dict[str, Any] = dict(
        data_type=torch.bfloat16,
        rank=0,
        world_size=1,
        hidden_dim=128,
        scale_dim=0,
        scale_type_size=4,
        max_token_type_size=2,
        max_num_inp_token_per_rank=8,
        num_experts_per_rank=4,
        num_experts_per_token=2,
    )
    base.update(fields)
    return EpDispatchCombineConfig(**base)


@contextlib.contextmanager
def op_env(env: Optional[dict[str, str]]) -> Iterator[None]:
    """``env`` set while an EP op is built (it reads MORI_EP_PUSH_STAGE_TOKENS, MORI_EP_PUSH_OVERLAP*,
    MORI_EP_PUSH_REDUCE_BLOCKS and MORI_EP_COMBINE_ALGO once, then), restored afterwards."""
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def combine_input(op: Any, y: torch.Tensor, push: bool) -> torch.Tensor:
    """The experts' outputs ``y`` (one per received row, in order) as combine's input: ``y``
    itself in push mode, copied into the op's registered buffer in pull (zero-copy) mode."""
    if push:
        return y
    inp = op.get_registered_combine_input_buffer(y.dtype)
    inp[: y.shape[0]] = y
    return inp


def unique_dest_ranks(indices_row: list[int], num_experts: int, experts_per_rank: int) -> list[int]:
    """Sorted unique destination ranks of one token (the oracle's independent definition)."""
    return sorted({e // experts_per_rank for e in indices_row if 0 <= e < num_experts})


def visible_gpus() -> int:
    """CUDA devices torch sees (0 without a driver)."""
    try:
        return torch.cuda.device_count()
    except Exception:
        return 0


def need_ranks(world: int) -> None:
    """Skip the calling test unless ``world`` GPU ranks can be placed: at least one GPU visible
    (ranks share GPUs when there are fewer than ``world``) and ``MORI_RANKS_PER_GPU`` satisfiable."""
    import pytest

    from mori_core.placement import placement

    if visible_gpus() < 1:
        pytest.skip("needs a CUDA GPU (ranks share it when there are fewer GPUs than ranks)")
    try:
        placement(world)
    except ValueError as e:
        pytest.skip(str(e))


def rank_device(rank: int, world: int) -> torch.device:
    """In a rank: the CUDA device ``rank`` runs on (see :mod:`mori_core.placement`)."""
    from mori_core.placement import placement

    return torch.device("cuda", placement(world).device_index(rank))


def gpus_shared(world: int) -> bool:
    """True when the ``world`` ranks share GPUs here (timings are then not meaningful)."""
    from mori_core.placement import placement

    return placement(world).shared


def init_shmem_default() -> None:
    """In a rank: register the default process group as "default" and initialise mori shmem on it."""
    import torch.distributed as dist

    import mori_core.shmem as shmem

    torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
    shmem.shmem_torch_process_group_init("default")


def capture_graph(device: torch.device, body: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """In a rank: capture ``body()`` into a CUDA graph on a side stream (as CUDA graphs need).

    Returns the graph and what ``body`` returned (the tensors every replay rewrites). Ends with
    the device idle and every rank past its capture.
    """
    import torch.distributed as dist

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = body()
    torch.cuda.synchronize()
    dist.barrier()
    return graph, captured


def replay_graph(graph: torch.cuda.CUDAGraph, op: Any, static: dict[str, Any], fresh: dict[str, Any]) -> None:
    """In a rank: copy ``fresh``'s "x", "w" and "idx" into the captured inputs ``static``, replay
    ``graph`` once every rank has its new inputs, and raise the op's device-side errors."""
    import torch.distributed as dist

    for k in ("x", "w", "idx"):
        static[k].copy_(fresh[k])
    torch.cuda.synchronize()
    dist.barrier()  # a rank's replay reads the other ranks' buffers: all inputs must be in place
    graph.replay()
    torch.cuda.synchronize()
    op.check_error()
