"""GPU tests of the inter-node kernel types (skipped without a GPU or without NVSHMEM).

Ranks are placed by ``MORI_RANKS_PER_GPU`` (several share a GPU where there are fewer GPUs than
ranks). ``gpu_per_node=1`` makes every rank its own "node": every row crosses NVSHMEM;
``gpu_per_node=world/2`` is two "nodes", each with an NVLink (shmem heap) part. One spawn per
world size runs every selected configuration of that size, on both network paths:
``auto`` (peer nodes whose NVSHMEM heap is load/store-reachable are written directly: all of them
on one machine) and ``put`` (``MORI_EP_INTERNODE_PATH=put``: every peer through staged NVSHMEM
puts, chunked by ``put_rows``, as a network peer would be; NVSHMEM carries them over P2P here).

Knobs (environment): ``MORI_TEST_INTERNODE_CONFIGS`` (e.g. ``4x1,8x4``: world x gpu_per_node),
``MORI_TEST_INTERNODE_PATHS`` (default ``auto,put``), ``MORI_TEST_INTERNODE_TYPES``,
``MORI_TEST_INTERNODE_ROUNDS`` (back-to-back rounds, default 200),
``MORI_TEST_INTERNODE_CASE_ROUNDS`` (reference-checked rounds per dtype case, 1-3, default 3),
``MORI_TEST_INTERNODE_GRAPH=0`` (no CUDA-graph replay check; the section sets it at EP8, where two
ranks share each GPU and the reference op's exchanges run over gloo, through the host),
``MORI_TEST_INTERNODE_EXPECT_DIRECT=1`` (assert that ``auto`` found every peer node
load/store-reachable: true on one NVLink machine), ``MORI_TEST_INTERNODE_PATH_SPLIT`` (configurations,
e.g. ``4x2,8x1,8x4``, where each kernel type runs on one path only, alternating: type i of the
j-th split configuration of a world size takes path ``(i + j) % paths``, so each such
configuration runs every type once and both paths, and 8x1 + 8x4 together run every type on
every path; for the GPU machine's time budget, where two ranks share each GPU at EP8 and every
combination costs seconds). ``MORI_TEST_NET_MODE`` names NVSHMEM's transport setting in the
printed lines.

Oracles as in test_gpu_ep.py: dispatch rows bit-exact against the sources through
``get_dispatch_src_token_pos``; combine bit-exact against ReferenceEpDispatchCombineOp (same
kernel type and gpu_per_node) over the same NCCL group.
"""

from __future__ import annotations

import os
import time
import traceback

import pytest
import torch

from ep_dist_utils import need_ranks, rank_device, run_ranks
from test_gpu_ep import (
    NUM_EXPERTS,
    TOPK,
    _all_inputs,
    _assert_combine_equal,
    _check_dispatch,
    _combine_input,
    _dest_ranks,
    _graph_rounds,
    _init_shmem,
    _reference_combine,
)

pytestmark = [pytest.mark.gpu]

TYPES = ("InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL")
MODE = os.environ.get("MORI_TEST_NET_MODE", "default NVSHMEM transports")
# (world, gpu_per_node): two "nodes" and all-network at EP2, EP4 and EP8.
CONFIGS = [(2, 1), (4, 1), (4, 2), (8, 1), (8, 4)]
WORLDS = sorted({w for w, _ in CONFIGS})
ROUNDS = int(os.environ.get("MORI_TEST_INTERNODE_ROUNDS", "200"))
CASE_ROUNDS = min(3, max(1, int(os.environ.get("MORI_TEST_INTERNODE_CASE_ROUNDS", "3"))))
PATHS = tuple(p for p in os.environ.get("MORI_TEST_INTERNODE_PATHS", "auto,put").split(",") if p)
EXPECT_DIRECT = os.environ.get("MORI_TEST_INTERNODE_EXPECT_DIRECT") == "1"
GRAPH = os.environ.get("MORI_TEST_INTERNODE_GRAPH", "1") != "0"
PATH_SPLIT = tuple(c for c in os.environ.get("MORI_TEST_INTERNODE_PATH_SPLIT", "").split(",") if c)


def _selected_gpns(world: int) -> list[int]:
    """gpu_per_node values of ``world`` in CONFIGS that MORI_TEST_INTERNODE_CONFIGS selects."""
    want = [c for c in os.environ.get("MORI_TEST_INTERNODE_CONFIGS", "").split(",") if c]
    return [g for w, g in CONFIGS if w == world and (not want or f"{w}x{g}" in want)]


def _plan(world: int, gpns: list, paths: tuple, types: tuple, split: tuple) -> list[tuple[int, str, tuple]]:
    """(gpu_per_node, path, kernel types) in run order: every type on every path, except in the
    configurations named in ``split`` (``"4x2"``...), where type i of the j-th of them (in
    ``gpns`` order) runs on ``paths[(i + j) % len(paths)]`` only."""
    plan = []
    j = 0
    for gpn in gpns:
        cut = f"{world}x{gpn}" in split
        for p, path in enumerate(paths):
            sel = tuple(kt for i, kt in enumerate(types) if not cut or (i + j) % len(paths) == p)
            if sel:
                plan.append((gpn, path, sel))
        j += cut
    return plan


def _need(world: int = 2) -> None:
    need_ranks(world)
    import mori_core

    if not mori_core.build_info().get("internode"):
        pytest.skip("mori_core was built without NVSHMEM (no mori_core._internode)")


def _config(rank, world, kernel_type, gpn, hidden, max_tok, scale_dim=0, push=True, max_type=4, **kw):
    from mori_core.ops import EpDispatchCombineConfig, EpDispatchCombineKernelType

    return EpDispatchCombineConfig(
        data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=hidden, scale_dim=scale_dim,
        scale_type_size=4, max_token_type_size=max_type, max_num_inp_token_per_rank=max_tok,
        num_experts_per_rank=NUM_EXPERTS // world, num_experts_per_token=TOPK, use_external_inp_buf=push,
        kernel_type=EpDispatchCombineKernelType[kernel_type], gpu_per_node=gpn, block_num=24,
        warp_num_per_block=8, **kw,
    )


def _split(op, kernel_type: str) -> bool:
    return kernel_type == "AsyncLL"


def _dispatch(op, kernel_type, x, w, s, idx, launch=(-1, -1, -1)):
    bn, rbn, wpb = launch
    if _split(op, kernel_type):
        res = op.dispatch_send(x, w, s, idx, block_num=bn, warp_per_block=wpb)
        op.dispatch_recv()
        return res
    return op.dispatch(x, w, s, idx, block_num=bn, rdma_block_num=rbn, warp_per_block=wpb)


def _combine(op, kernel_type, y, w, idx, push):
    if _split(op, kernel_type):
        # combine_send uses the config's mode (MORI's signature has no override)
        res = op.combine_send(y, w, idx)
        op.combine_recv()
        return res
    return op.combine(y, w, idx, use_external_inp_buf=int(push))


def _round(op, ref, cfg, kernel_type, data, push, comb_dtype, launch):
    rank = cfg.rank
    mine = data[rank]
    res = _dispatch(op, kernel_type, mine["x"], mine["w"], mine["s"], mine["idx"], launch)
    n = _check_dispatch(op, cfg, data, res)
    out, out_w = res[0], res[1]
    ref_res = ref.dispatch(mine["x"], mine["w"], mine["s"], mine["idx"])
    assert int(ref_res[4][0]) == n, f"received {n} rows, the reference {int(ref_res[4][0])}"
    comb_in = _combine_input(op, out, n, rank, comb_dtype, push, spare_rows=2)
    comb, comb_w = _combine(op, kernel_type, comb_in, out_w[:n].clone(), mine["idx"], push)
    ref_comb, ref_comb_w = _reference_combine(ref, cfg, ref_res, mine["idx"], out, comb_dtype)
    torch.cuda.synchronize()
    op.check_error()
    _assert_combine_equal(comb, comb_w, ref_comb, ref_comb_w, mine["x"].shape[0])


def _check_paths(paths: dict, world: int, gpn: int, path: str) -> str:
    """An op's network paths (``network_paths``) match the requested one; returns them for the
    PASS line."""
    peers = world // gpn - 1
    assert paths["direct"] + paths["put"] == peers, f"{paths} for {peers} peer nodes"
    if path == "put":
        assert paths == {"direct": 0, "put": peers}, f"MORI_EP_INTERNODE_PATH=put left {paths}"
    elif EXPECT_DIRECT:
        assert paths == {"direct": peers, "put": 0}, f"expected every peer node load/store-reachable, got {paths}"
    return f"direct={paths['direct']} put={paths['put']}"


def _one_type(rank, world, kernel_type, gpn, dev, path):
    import torch.distributed as dist

    from mori_core.ops import EpDispatchCombineOp, ReferenceEpDispatchCombineOp

    fp8 = torch.float8_e4m3fn
    cases = [  # hidden, dtype, scale_dim, comb_dtype, push
        (7168, torch.bfloat16, 0, torch.bfloat16, True),
        (7168, fp8, 56, torch.bfloat16, False),
        (2048, torch.float32, 0, torch.float32, True),
    ]
    max_tok = 96
    for ci, (hidden, dtype, scale_dim, comb_dtype, push) in enumerate(cases):
        cfg = _config(rank, world, kernel_type, gpn, hidden, max_tok, scale_dim=scale_dim, push=push)
        op = EpDispatchCombineOp(cfg)
        assert type(op).__name__ == "InterNodeEpDispatchCombineOp"
        ref = ReferenceEpDispatchCombineOp(cfg, device=dev)
        paths = op._engine.network_paths
        for rnd in range(CASE_ROUNDS):
            g = torch.Generator().manual_seed(100 * ci + rnd + 7)
            counts = torch.randint(0, max_tok + 1, (world,), generator=g).tolist()
            counts[(ci + rnd) % world] = 0  # a rank with no tokens every round
            counts[(ci + rnd + 1) % world] = max_tok
            data = _all_inputs(100 * ci + rnd, world, counts, hidden, dtype, scale_dim, dev)
            launch = [(-1, -1, -1), (5, 2, 3), (64, 32, 16)][rnd]
            # put path: one put per row, chunks that end short, and whole batches per put
            op._handle.put_rows = [1, 3, 64][(rnd + ci) % 3]
            _round(op, ref, cfg, kernel_type, data, push, comb_dtype, launch)
        op.close()
        dist.barrier()

    if GRAPH and kernel_type in ("InterNodeV1LL", "AsyncLL"):
        _graph(rank, world, kernel_type, gpn, dev)
    _back_to_back(rank, world, kernel_type, gpn, dev, ROUNDS)
    return _check_paths(paths, world, gpn, path)  # after the rounds: a path mismatch still runs them


def _back_to_back(rank, world, kernel_type, gpn, dev, rounds):
    """``rounds`` dispatch + combine rounds without host synchronisation. Identity experts; the
    input flips sign every round, so round i's combine equals (-1)^i times round 0's, and the
    last round equals x times the number of unique destination ranks of each token."""
    import torch.distributed as dist

    from mori_core.ops import EpDispatchCombineOp

    if rounds <= 0:
        return
    cfg = _config(rank, world, kernel_type, gpn, 2048, 64, push=True, max_type=2)
    op = EpDispatchCombineOp(cfg)
    mine = _all_inputs(9, world, [64] * world, 2048, torch.bfloat16, 0, dev)[rank]
    x = mine["x"].clone()
    sums = torch.zeros(rounds, dtype=torch.float64, device=dev)
    torch.cuda.synchronize()
    dist.barrier()
    for i in range(rounds):
        out, out_w, _, _, _ = _dispatch(op, kernel_type, x, mine["w"], None, mine["idx"])
        comb, _ = _combine(op, kernel_type, out, out_w, mine["idx"], True)
        sums[i] = comb[:64].to(torch.float64).sum()
        x.neg_()
    torch.cuda.synchronize()
    op.check_error()
    sums = sums.cpu()
    assert sums[0] != 0
    assert torch.all(sums[0::2] == sums[0]) and torch.all(sums[1::2] == -sums[0]), (
        f"{kernel_type}: a round of {rounds} produced different data: {sums[:6].tolist()}"
    )
    last = mine["x"].float() * (1.0 if (rounds - 1) % 2 == 0 else -1.0)
    want = _node_first_sum(last, mine["idx"], cfg.num_experts_per_rank, world, gpn)
    assert torch.equal(comb[:64], want), f"{kernel_type}: last round differs"
    op.close()
    dist.barrier()


def _node_first_sum(x: torch.Tensor, idx: torch.Tensor, experts_per_rank: int, world: int, gpn: int) -> torch.Tensor:
    """Identity experts' combine as the inter-node kernels sum it: inside each node first (x times
    the node's destination ranks, rounded once to bf16), then the nodes' partial rows in fp32,
    rounded again. With 3 destination ranks in one node, bf16(3x) is already rounded, so this can
    differ from bf16(x * destination ranks) in the last bit."""
    hit = _dest_ranks(idx, experts_per_rank, world)
    per_node = hit.view(idx.shape[0], world // gpn, gpn).sum(2).to(torch.float32)
    acc = torch.zeros_like(x, dtype=torch.float32)
    for m in range(world // gpn):  # ascending node order, as the kernels add them
        acc += (x * per_node[:, m : m + 1]).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def _graph(rank, world, kernel_type, gpn, dev):
    """Capture dispatch + combine (split calls for AsyncLL) in a CUDA graph; replay with fresh
    data in the captured tensors and check every replay."""
    import torch.distributed as dist

    from mori_core.ops import EpDispatchCombineOp, ReferenceEpDispatchCombineOp

    hidden, ntoks = 7168, [40 + 3 * r for r in range(world)]
    cfg = _config(rank, world, kernel_type, gpn, hidden, 64, push=True, max_type=2)
    op = EpDispatchCombineOp(cfg)
    ref = ReferenceEpDispatchCombineOp(cfg, device=dev)
    _graph_rounds(
        op, ref, cfg, dev, ntoks, hidden,
        lambda x, w, scales, idx: _dispatch(op, kernel_type, x, w, scales, idx),
        lambda y, w, idx: _combine(op, kernel_type, y, w, idx, True), replays=3,
    )
    op.close()
    dist.barrier()


def _suite(rank: int, world: int, gpns: list, paths: tuple, types: tuple, split: tuple = ()) -> None:
    """Every (gpu_per_node, path, kernel type) of :func:`_plan` in turn; failures are collected (each
    printed with its traceback) so one run shows all of them."""
    import torch.distributed as dist

    import mori_core.shmem as shmem
    from mori_core.ops.internode import PATH_ENV

    _init_shmem()
    dev = rank_device(rank, world)
    failures = {}
    for gpn, path, sel in _plan(world, gpns, paths, types, split):
        os.environ[PATH_ENV] = path  # read by every op created below, on every rank
        for kt in sel:
            what = f"{kt} {world}x{gpn} path={path}"
            t0 = time.monotonic()
            try:
                got = _one_type(rank, world, kt, gpn, dev, path)
                status = f"PASS ({got})"
            except Exception:  # collect and go on: the other types still run
                failures[what] = traceback.format_exc()
                status = "FAIL " + failures[what].strip().splitlines()[-1][:300]
                # Printed here, whole: leaving this block frees the failed op, and its close() is a
                # collective that waits for peers still inside this type (the run can then hang).
                print(f"INTERNODE rank={rank} type={kt} traceback:\n{failures[what]}", flush=True)
            print(f"INTERNODE rank={rank} type={kt} gpu_per_node={gpn} world={world} path={path} mode={MODE} "
                  f"rounds={ROUNDS} graph={'yes' if GRAPH and kt in ('InterNodeV1LL', 'AsyncLL') else 'no'} "
                  f"{time.monotonic() - t0:.1f}s: {status}", flush=True)
            dist.barrier()
    os.environ.pop(PATH_ENV, None)
    shmem.shmem_finalize()
    if failures:
        raise AssertionError("\n".join(f"[{what}]\n{tb}" for what, tb in failures.items()))


@pytest.mark.parametrize("world", WORLDS)
def test_internode_kernel_types(world: int) -> None:
    """Every selected configuration of ``world`` ranks, both network paths, every kernel type."""
    gpns = _selected_gpns(world)
    if not gpns:
        pytest.skip(f"no {world}x* configuration in MORI_TEST_INTERNODE_CONFIGS")
    _need(world)
    types = tuple(t for t in os.environ.get("MORI_TEST_INTERNODE_TYPES", ",".join(TYPES)).split(",") if t)
    run_ranks(_suite, world, backend="nccl", timeout=float(os.environ.get("MORI_TEST_INTERNODE_TIMEOUT", "400")),
              gpns=gpns, paths=PATHS, types=types, split=PATH_SPLIT, env={"MORI_SHMEM_HEAP_SIZE": "4G"})


def _bringup(rank: int, world: int) -> None:
    """NVSHMEM through our bootstrap, then one put-with-signal each way, verified."""
    import mori_core.shmem as shmem
    from mori_core.ops.internode import ensure_network, load_internode

    _init_shmem()
    ensure_network(_config(rank, world, "InterNodeV1", 1, 256, 16), 1 << 20)
    mod = load_internode()
    assert mod.nvshmem_my_pe() == rank and mod.nvshmem_n_pes() == world
    for nbytes in (4096, 8 << 20):
        r = mod.nvshmem_self_test((rank + 1) % world, nbytes, 20000)
        print(f"BRINGUP rank={rank} mode={MODE} bytes={nbytes}: {r}", flush=True)
        assert r["ok"] == 1.0, f"put-with-signal self test failed: {r}"
    shmem.shmem_finalize()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nvshmem_bringup(world: int) -> None:
    _need(world)
    run_ranks(_bringup, world, backend="nccl", timeout=120)


def _timeout(rank: int, world: int, types: tuple, paths: tuple) -> None:
    """Every rank but the last dispatches; the last never does. Rank 0 (on another "node":
    gpu_per_node=1) must report a timeout naming the missing peer, for every kernel type and
    network path."""
    import torch.distributed as dist

    import mori_core.shmem as shmem
    from mori_core.ops import EpDispatchCombineOp, EpOpError
    from mori_core.ops.internode import PATH_ENV

    _init_shmem()
    dev = rank_device(rank, world)
    missing = world - 1
    for kernel_type, path in [(kt, p) for p in paths for kt in types]:
        os.environ[PATH_ENV] = path
        cfg = _config(rank, world, kernel_type, 1, 256, 16, max_type=2)
        op = EpDispatchCombineOp(cfg)
        x = torch.ones(16, 256, dtype=torch.bfloat16, device=dev)
        idx = torch.zeros(16, TOPK, dtype=torch.int32, device=dev)
        idx[:, 0] = missing * cfg.num_experts_per_rank  # every token also goes to the missing rank
        if rank != missing:
            op.timeout_ms = 500
            if _split(op, kernel_type):
                op.dispatch_send(x, None, None, idx)
                op.dispatch_recv()
            else:
                op.dispatch(x, None, None, idx)
            if rank == 0:
                with pytest.raises(EpOpError, match=rf"timed out .* waiting for peer rank {missing} \(node {missing}"):
                    op.check_error()
                print(f"TIMEOUT {kernel_type} path={path} world={world} rank 0 reported: "
                      f"{op._handle.error_message()}", flush=True)
                # the failed op refuses the next call (checked at launch, before any kernel runs)
                with pytest.raises(EpOpError, match="timed out"):
                    op.dispatch(x, None, None, idx)
        torch.cuda.synchronize()
        dist.barrier()
        op.close()  # a failed op is not reused: the next type gets fresh (zeroed) buffers
        dist.barrier()
    os.environ.pop(PATH_ENV, None)
    shmem.shmem_finalize()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_timeout_names_the_missing_peer(world: int) -> None:
    _need(world)
    types = tuple(t for t in os.environ.get("MORI_TEST_INTERNODE_TYPES", ",".join(TYPES)).split(",") if t)
    run_ranks(_timeout, world, backend="nccl", timeout=180, types=types, paths=PATHS)
