"""GPU tests of the standard-MoE layout, FP8 combine and (in profiler builds) the kernel profiler,
at EP1 (every token stays local, every kernel path still runs), EP2, EP4 and EP8 (ranks placed by
``MORI_RANKS_PER_GPU``: several share a GPU where there are fewer GPUs than ranks).
Run by ``bash tools/gpu/ep15.sh``.

Oracle: ReferenceEpDispatchCombineOp over the same process group, bit-exact:
* dispatch_standard_moe: each local expert's rows ``[:count]``, counts, source infos, layout
  ranges and scales equal the reference's (stable source-rank-then-token order), and equal
  ``convert_dispatch_output(dispatch(...))`` on the GPU op;
* combine_standard_moe equals the reference's, and equals ``combine(convert_combine_input(...))``
  on the GPU op in push and pull mode;
* FP8 combine (fp8_direct_cast / fp8_blockwise, push and pull, plain and standard-MoE) equals the
  reference's FP8 numerics.
Every case runs even if an earlier one failed; each failure names the case, the rank and the
first mismatch, so one run tells what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import traceback
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from ep_dist_utils import (
    all_rank_inputs,
    capture_graph,
    combine_input,
    init_shmem_default,
    need_ranks,
    op_env,
    rank_device,
    replay_graph,
    run_ranks,
)

pytestmark = [pytest.mark.gpu]

WORLDS = [1, 2, 4, 8]
ROUNDS = int(os.environ.get("MORI_TEST_ROUNDS", "100"))  # back-to-back standard-MoE rounds
STAGE = "MORI_EP_PUSH_STAGE_TOKENS"  # staged push combine: tokens per chunk (read when an op is built)
ALGO = "MORI_EP_COMBINE_ALGO"
PER_DEST = "MORI_EP_DISPATCH_PER_DEST_WARPS"  # dispatch: one destination rank per copy item from this many warps
FUSED = "MORI_EP_STD_FUSED"  # dispatch_standard_moe: 0 three launches (plan kernel first), 2 one launch
OVERLAP = "MORI_EP_PUSH_OVERLAP"  # overlapped push combine: 0 / 1 / auto
OVERLAP_REDUCE = "MORI_EP_PUSH_OVERLAP_REDUCE_BLOCKS"


_need = need_ranks
_init_shmem = init_shmem_default  # (run in ranks)


def _config(rank, world, hidden, max_tok, epr, topk, scale_dim=0, max_type=2, quant="none", push=True):
    from mori_core.ops import EpDispatchCombineConfig

    return EpDispatchCombineConfig(
        data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=hidden, scale_dim=scale_dim,
        scale_type_size=4, max_token_type_size=max_type, max_num_inp_token_per_rank=max_tok,
        num_experts_per_rank=epr, num_experts_per_token=topk, quant_type=quant, use_external_inp_buf=push,
        block_num=64, warp_num_per_block=8,
    )


def _inputs(seed, world, counts, hidden, num_experts, topk, dtype, scale_dim, dup, device):
    """Every rank's inputs (identical on every rank), gating weights in [0.25, 1.25); ``dup``
    repeats an expert in some tokens."""
    return all_rank_inputs(seed, world, counts, hidden, num_experts, topk, dtype, scale_dim, device,
                           min_weight=0.25, repeat_expert=dup)


@contextlib.contextmanager
def _op_and_reference(cfg: Any, dev: torch.device, env: Optional[dict[str, str]] = None) -> Iterator[tuple[Any, Any]]:
    """The GPU op (built with the op settings ``env``) and the reference op on ``cfg``; on leaving
    (a failed case too) the GPU op is closed once the device is idle, in step with the other ranks
    (closing is collective)."""
    import torch.distributed as dist

    from mori_core.ops import EpDispatchCombineOp, ReferenceEpDispatchCombineOp

    with op_env(env):
        op = EpDispatchCombineOp(cfg)
    ref = ReferenceEpDispatchCombineOp(cfg, device=dev)
    try:
        yield op, ref
    finally:
        torch.cuda.synchronize()
        op.close()
        dist.barrier()


def _first_diff(name: str, got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """None when bit-identical, else a description of the first mismatch."""
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    g, w = got.detach().reshape(-1), want.detach().reshape(-1)
    if g.dtype.is_floating_point:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
        ne = g.view(bits) != w.view(bits)
    else:
        ne = g != w
    if not bool(ne.any()):
        return None
    i = int(torch.nonzero(ne)[0])
    idx = torch.unravel_index(torch.tensor(i), got.shape)
    d = ""
    if g.dtype.is_floating_point:
        d = f", max |diff| {(g.float() - w.float()).abs().max().item():.4g}"
    return (f"{name}: {int(ne.sum())} of {g.numel()} elements differ; first at {tuple(int(j) for j in idx)}: "
            f"got {g[i].item()!r}, expected {w[i].item()!r}{d}")


def _expert_rows(packed: torch.Tensor, count: torch.Tensor, rank: int, epr: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Expert e's outputs: x * (e + 1) / 8 on its valid rows, NaN beyond (must never be read)."""
    y = torch.full(packed.shape, float("nan"), dtype=out_dtype, device=packed.device)
    for el in range(packed.shape[0]):
        c = int(count[el])
        y[el, :c] = (packed[el, :c].to(torch.float32) * ((rank * epr + el + 1) / 8.0)).to(out_dtype)
    return y


def _check_layout(op, ref, got: tuple, want: tuple, scale_dim: int) -> list[str]:
    errs = []
    px, cnt, info, lr = got
    rpx, rcnt, rinfo, rlr = want
    for name, a, b in (("packed_recv_count", cnt, rcnt), ("packed_recv_layout_range", lr, rlr)):
        e = _first_diff(name, a.cpu(), b.cpu())
        if e:
            errs.append(e)
    if errs:
        return errs  # rows cannot be compared without equal counts
    for el in range(px.shape[0]):
        c = int(rcnt[el])
        for name, a, b in ((f"packed_recv_x[{el}]", px[el, :c], rpx[el, :c]),
                           (f"packed_recv_src_info[{el}]", info[el, :c], rinfo[el, :c])):
            e = _first_diff(name, a.cpu(), b.cpu())
            if e:
                errs.append(e)
        if scale_dim:
            e = _first_diff(f"packed scales[{el}]", op.get_packed_recv_scales()[el, :c].cpu(),
                            ref.get_packed_recv_scales()[el, :c].cpu())
            if e:
                errs.append(e)
        if len(errs) > 6:
            break
    return errs


def _std_case(rank, world, dev, seed, hidden, dtype, scale_dim, num_experts, topk, out_dtype, weighted, dup, quant,
              launch, max_tok=96, env=None) -> list[str]:
    """One standard-MoE round on the GPU op (op settings ``env``) and the reference; returns the mismatches."""
    import torch.distributed as dist

    errs: list[str] = []
    epr = num_experts // world
    cfg = _config(rank, world, hidden, max_tok, epr, topk, scale_dim, max_type=max(2, dtype.itemsize, out_dtype.itemsize),
                  quant=quant)
    with _op_and_reference(cfg, dev, env) as (op, ref):
        for rnd in range(2):
            g = torch.Generator().manual_seed(seed * 7 + rnd)
            counts = torch.randint(0, max_tok + 1, (world,), generator=g).tolist()
            counts[(seed + rnd) % world] = 0 if rnd == 0 else max_tok
            data = _inputs(seed * 7 + rnd, world, counts, hidden, epr * world, topk, dtype, scale_dim, dup, dev)
            mine = data[rank]
            w = mine["w"] if weighted else None
            bn, wpb = launch
            got = op.dispatch_standard_moe(mine["x"], w, mine["s"], mine["idx"], block_num=bn, warp_per_block=wpb)
            got = tuple(t.clone() for t in got)
            torch.cuda.synchronize()
            op.check_error()
            want = ref.dispatch_standard_moe(mine["x"], w, mine["s"], mine["idx"])
            errs += [f"round {rnd} dispatch_standard_moe: {e}" for e in _check_layout(op, ref, got, want, scale_dim)]
            y = _expert_rows(got[0], got[1], rank, epr, out_dtype)
            comb, none = op.combine_standard_moe(y, None, mine["idx"], block_num=bn, warp_per_block=wpb)
            comb = comb[: counts[rank]].clone()
            torch.cuda.synchronize()
            op.check_error()
            assert none is None
            ry = _expert_rows(want[0], want[1], rank, epr, out_dtype)
            rcomb, _ = ref.combine_standard_moe(ry, None, mine["idx"])
            e = _first_diff(f"round {rnd} combine_standard_moe vs reference", comb, rcomb[: counts[rank]])
            if e:
                errs.append(e)
            # The same through the 2-D path on the GPU op: dispatch + convert, convert + combine (push, pull).
            out, _, _, out_idx, total = op.dispatch(mine["x"], w, mine["s"], mine["idx"])
            conv = tuple(t.clone() for t in op.convert_dispatch_output(out, out_idx))
            torch.cuda.synchronize()
            op.check_error()
            for name, a, b in (("count", conv[1], got[1]), ("layout_range", conv[3], got[3])):
                e = _first_diff(f"round {rnd} convert_dispatch_output {name} vs dispatch_standard_moe", a, b)
                if e:
                    errs.append(e)
            for el in range(epr):
                c = int(got[1][el])
                e = _first_diff(f"round {rnd} convert_dispatch_output rows[{el}] vs dispatch_standard_moe",
                                conv[0][el, :c], got[0][el, :c]) or _first_diff(
                    f"round {rnd} convert_dispatch_output src_info[{el}]", conv[2][el, :c], got[2][el, :c])
                if e:
                    errs.append(e)
                    break
            for push in (1, 0):
                rows = op.convert_combine_input(y)
                c2, _ = op.combine(rows, None, mine["idx"], use_external_inp_buf=push)
                e = _first_diff(f"round {rnd} combine(convert_combine_input) push={push} vs combine_standard_moe",
                                c2[: counts[rank]], comb)
                torch.cuda.synchronize()
                op.check_error()
                if e:
                    errs.append(e)
            dist.barrier()
    return errs


def _every_bf16_value(dev: torch.device) -> torch.Tensor:
    """All 65,536 bf16 bit patterns but the NaNs (normal, subnormal, above 448, +-inf, +-0)."""
    vals = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return vals[~torch.isnan(vals)].to(dev)


def _fp8_case(rank, world, dev, seed, quant, push, hidden=7168, max_tok=128, env=None, codec=False) -> list[str]:
    """A plain dispatch + FP8 combine on the GPU op (op settings ``env``) vs the reference.

    ``codec``: the tokens are every non-NaN bf16 value in turn and the experts return them
    unchanged, so the device's e4m3 encode and decode meet ties, subnormals, saturation and
    infinities (the reference quantises with torch's float8_e4m3fn cast)."""
    import torch.distributed as dist

    errs: list[str] = []
    epr, topk = 256 // world, 8
    cfg = _config(rank, world, hidden, max_tok, epr, topk, quant=quant, push=push)
    with _op_and_reference(cfg, dev, env) as (op, ref):
        for rnd in range(2):
            counts = [max_tok - 17 * r - 5 * rnd for r in range(world)]
            data = _inputs(seed + rnd, world, counts, hidden, epr * world, topk, torch.bfloat16, 0, False, dev)
            mine = data[rank]
            mult = 3.0 + rank
            if codec:
                vals = _every_bf16_value(dev)
                pos = torch.arange(counts[rank] * hidden, device=dev) + (rank * 7919 + rnd * 104729)
                mine = dict(mine, x=vals[pos % vals.numel()].view(counts[rank], hidden))
                mult = 1.0
            out, out_w, _, _, total = op.dispatch(mine["x"], mine["w"], None, mine["idx"])
            torch.cuda.synchronize()
            n = int(total[0])
            y = (out[:n].to(torch.float32) * mult).to(torch.bfloat16)
            comb, comb_w = op.combine(combine_input(op, y, push), out_w, mine["idx"])
            comb = comb[: counts[rank]].clone()
            comb_w = comb_w[: counts[rank]].clone()
            torch.cuda.synchronize()
            op.check_error()
            rres = ref.dispatch(mine["x"], mine["w"], None, mine["idx"])
            rn = int(rres[4][0])
            ry = torch.zeros(cfg.max_num_tokens_to_recv(), hidden, dtype=torch.bfloat16, device=dev)
            ry[:rn] = (rres[0][:rn].to(torch.float32) * mult).to(torch.bfloat16)
            rcomb, rcomb_w = ref.combine(ry, rres[1], mine["idx"], use_external_inp_buf=1)
            for name, a, b in (("combine", comb, rcomb[: counts[rank]]), ("combine weights", comb_w, rcomb_w[: counts[rank]])):
                e = _first_diff(f"{quant} push={push} round {rnd} {name} vs reference", a, b)
                if e:
                    errs.append(e)
            dist.barrier()
    return errs


def _graph_case(rank, world, dev, env=None) -> list[str]:
    """dispatch_standard_moe + combine_standard_moe captured in a CUDA graph, replayed with new data
    (op settings ``env``)."""
    errs: list[str] = []
    hidden, epr, topk, n = 2048, 16 // world, 4, 64
    cfg = _config(rank, world, hidden, n, epr, topk)
    with _op_and_reference(cfg, dev, env) as (op, ref):
        static = _inputs(90, world, [n] * world, hidden, epr * world, topk, torch.bfloat16, 0, False, dev)[rank]
        op.dispatch_standard_moe(static["x"], static["w"], None, static["idx"])  # first call allocates (not capturable)
        torch.cuda.synchronize()

        def step():
            px, cnt, _, _ = op.dispatch_standard_moe(static["x"], static["w"], None, static["idx"])
            y = (px.to(torch.float32) * 0.5).to(torch.bfloat16)  # every row, valid or not (finite garbage)
            comb, _ = op.combine_standard_moe(y, None, static["idx"])
            return cnt, comb

        graph, (cnt, comb) = capture_graph(dev, step)
        for rep in range(3):
            data = _inputs(91 + rep, world, [n] * world, hidden, epr * world, topk, torch.bfloat16, 0, False, dev)
            replay_graph(graph, op, static, data[rank])
            want = ref.dispatch_standard_moe(static["x"], static["w"], None, static["idx"])
            e = _first_diff(f"graph replay {rep} count", cnt, want[1])
            ry = (want[0].to(torch.float32) * 0.5).to(torch.bfloat16)
            rcomb, _ = ref.combine_standard_moe(ry, None, static["idx"])
            e = e or _first_diff(f"graph replay {rep} combine_standard_moe", comb[:n], rcomb[:n])
            if e:
                errs.append(e)
        del graph
        # Back to back, no host sync: ROUNDS standard-MoE rounds; identity experts, sign flips each round.
        x = static["x"].clone()
        sums = torch.zeros(ROUNDS, dtype=torch.float64, device=dev)
        for i in range(ROUNDS):
            px, cnt, _, _ = op.dispatch_standard_moe(x, static["w"], None, static["idx"])
            comb, _ = op.combine_standard_moe(px, None, static["idx"])
            sums[i] = comb[:n].to(torch.float64).sum()
            x.neg_()
        torch.cuda.synchronize()
        op.check_error()
        sums = sums.cpu()
        if not (torch.all(sums[0::2] == sums[0]) and torch.all(sums[1::2] == -sums[0]) and sums[0] != 0):
            errs.append(f"{ROUNDS} back-to-back rounds: sums differ between rounds: {sums[:4].tolist()} ...")
        # A plain dispatch invalidates the layout: combine_standard_moe must report it, not read stale rows.
        from mori_core.ops import EpOpError

        op.dispatch(static["x"], static["w"], None, static["idx"])
        op.combine_standard_moe(px, None, static["idx"])
        try:
            op.check_error()
            errs.append("combine_standard_moe after a plain dispatch was not reported")
        except EpOpError as ex:
            if "standard-MoE layout" not in str(ex):
                errs.append(f"stale-layout error message: {ex}")
    return errs


def _suite(rank: int, world: int, out_path: str) -> None:
    import torch.distributed as dist

    _init_shmem()
    dev = rank_device(rank, world)
    fp8 = torch.float8_e4m3fn
    cases: list[tuple[str, Callable[[], list[str]]]] = [
        # (seed, hidden, dispatch dtype, scale_dim, experts in total, topk, combine dtype, weighted, dup ids, quant, launch)
        ("std bf16 h7168 256 experts top8 weighted", lambda: _std_case(
            rank, world, dev, 1, 7168, torch.bfloat16, 0, 256, 8, torch.bfloat16, True, False, "none", (-1, -1))),
        ("std bf16 launch 7x3 dup experts", lambda: _std_case(
            rank, world, dev, 2, 4096, torch.bfloat16, 0, 32, 8, torch.bfloat16, True, True, "none", (7, 3))),
        ("std fp8+scales dispatch, bf16 combine", lambda: _std_case(
            rank, world, dev, 3, 4096, fp8, 32, 64, 8, torch.bfloat16, True, False, "none", (-1, -1))),
        # fused ranking (the default) in rounds of 32 tokens per block (one warp, 96 tokens on 2 blocks)
        ("std bf16 launch 2x1 dup experts", lambda: _std_case(
            rank, world, dev, 8, 2048, torch.bfloat16, 0, 32, 8, torch.bfloat16, True, True, "none", (2, 1))),
        # the three-launch path, the same cases
        ("std bf16 launch 7x3 dup experts, three launches", lambda: _std_case(
            rank, world, dev, 2, 4096, torch.bfloat16, 0, 32, 8, torch.bfloat16, True, True, "none", (7, 3),
            env={FUSED: "0"})),
        ("std fp8+scales dispatch, three launches", lambda: _std_case(
            rank, world, dev, 3, 4096, fp8, 32, 64, 8, torch.bfloat16, True, False, "none", (-1, -1),
            env={FUSED: "0"})),
        # one launch (the expand as the dispatch kernel's tail, a grid larger than the senders')
        ("std bf16 h7168 256 experts top8 weighted, one launch", lambda: _std_case(
            rank, world, dev, 1, 7168, torch.bfloat16, 0, 256, 8, torch.bfloat16, True, False, "none", (-1, -1),
            env={FUSED: "2"})),
        ("std fp8+scales launch 2x1 dup experts, one launch", lambda: _std_case(
            rank, world, dev, 9, 2048, fp8, 16, 32, 8, torch.bfloat16, True, True, "none", (2, 1),
            env={FUSED: "2"})),
        # per-destination copy items (every dispatch; the fused and one-launch paths)
        ("std bf16 dup experts, per-destination copies", lambda: _std_case(
            rank, world, dev, 2, 4096, torch.bfloat16, 0, 32, 8, torch.bfloat16, True, True, "none", (7, 3),
            env={PER_DEST: "0"})),
        ("std fp8+scales launch 2x1 dup experts, one launch, per-destination copies", lambda: _std_case(
            rank, world, dev, 9, 2048, fp8, 16, 32, 8, torch.bfloat16, True, True, "none", (2, 1),
            env={FUSED: "2", PER_DEST: "0"})),
        ("std fp32 unweighted top6 dup", lambda: _std_case(
            rank, world, dev, 4, 2048, torch.float32, 0, 8, 6, torch.float32, False, True, "none", (132, 16), max_tok=64)),
        # top-2 (a compile-time top-k of the dispatch's count other than 8), repeats included
        ("std bf16 top2 dup", lambda: _std_case(
            rank, world, dev, 14, 2048, torch.bfloat16, 0, 16, 2, torch.bfloat16, True, True, "none", (-1, -1))),
        ("std bf16 + fp8_blockwise combine", lambda: _std_case(
            rank, world, dev, 5, 7168, torch.bfloat16, 0, 128, 8, torch.bfloat16, True, False, "fp8_blockwise", (-1, -1))),
        ("std bf16 + fp8_direct_cast combine", lambda: _std_case(
            rank, world, dev, 6, 2048, torch.bfloat16, 0, 16, 4, torch.bfloat16, True, True, "fp8_direct_cast", (-1, -1))),
        ("fp8_blockwise push", lambda: _fp8_case(rank, world, dev, 10, "fp8_blockwise", True)),
        ("fp8_blockwise pull", lambda: _fp8_case(rank, world, dev, 11, "fp8_blockwise", False)),
        ("fp8_direct_cast push", lambda: _fp8_case(rank, world, dev, 12, "fp8_direct_cast", True)),
        ("fp8_direct_cast pull h4096", lambda: _fp8_case(rank, world, dev, 13, "fp8_direct_cast", False, hidden=4096)),
        ("fp8_direct_cast codec, every bf16 value, push", lambda: _fp8_case(
            rank, world, dev, 19, "fp8_direct_cast", True, codec=True)),
        ("fp8_direct_cast codec, every bf16 value, pull", lambda: _fp8_case(
            rank, world, dev, 20, "fp8_direct_cast", False, codec=True)),
        # staged push (chunks of 32 of the 128 tokens), and the pull kernel (quantise, then read) of a pull call
        ("fp8_blockwise push staged", lambda: _fp8_case(rank, world, dev, 14, "fp8_blockwise", True, env={STAGE: "32"})),
        ("fp8_direct_cast pull staged", lambda: _fp8_case(rank, world, dev, 15, "fp8_direct_cast", False,
                                                            env={STAGE: "32"})),
        ("fp8_blockwise pull kernel", lambda: _fp8_case(rank, world, dev, 16, "fp8_blockwise", False,
                                                          env={ALGO: "pull"})),
        ("std bf16 staged combine", lambda: _std_case(
            rank, world, dev, 7, 7168, torch.bfloat16, 0, 256, 8, torch.bfloat16, True, False, "none", (-1, -1),
            env={STAGE: "24"})),
        # overlapped push (every round): FP8 transport, standard MoE (plain and FP8), every block
        # reducing once it has pushed, few blocks
        ("fp8_direct_cast push overlapped", lambda: _fp8_case(rank, world, dev, 17, "fp8_direct_cast", True,
                                                                env={OVERLAP: "1"})),
        ("fp8_blockwise push overlapped, all blocks reduce", lambda: _fp8_case(
            rank, world, dev, 18, "fp8_blockwise", True, env={OVERLAP: "1", OVERLAP_REDUCE: "0"})),
        ("std bf16 overlapped combine", lambda: _std_case(
            rank, world, dev, 8, 7168, torch.bfloat16, 0, 256, 8, torch.bfloat16, True, False, "none", (-1, -1),
            env={OVERLAP: "1"})),
        ("std bf16 + fp8_direct_cast overlapped, launch 7x3", lambda: _std_case(
            rank, world, dev, 9, 2048, torch.bfloat16, 0, 16, 4, torch.bfloat16, True, True, "fp8_direct_cast", (7, 3),
            env={OVERLAP: "1"})),
        ("std graph + 100 rounds + stale layout", lambda: _graph_case(rank, world, dev)),
        ("std graph + 100 rounds + stale layout, one launch", lambda: _graph_case(rank, world, dev, {FUSED: "2"})),
    ]
    results = {}
    for name, fn in cases:
        try:
            errs = fn()
        except Exception:
            errs = [traceback.format_exc(limit=6)]
        results[name] = errs
        print(f"[rank {rank}] {'PASS' if not errs else 'FAIL'} {name}" + ("" if not errs else "\n  " + "\n  ".join(errs)),
              flush=True)
        # keep the ranks in step even after a failure (both run every case)
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f, indent=1)
    import mori_core.shmem as shmem

    shmem.shmem_finalize()
    bad = {name: errs for name, errs in results.items() if errs}
    assert not bad, "\n".join(f"{name}:\n  " + "\n  ".join(errs) for name, errs in bad.items())


@pytest.mark.parametrize("world", WORLDS)
def test_standard_moe_and_fp8_combine(world: int) -> None:
    _need(world)
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp()
    run_ranks(_suite, world, backend="nccl", timeout=400,
              env={"MORI_SHMEM_HEAP_SIZE": "8G", "MORI_EP_TIMEOUT_MS": "5000"},
              out_path=os.path.join(out_dir, f"ep15_cases_ep{world}.json"))


# ----------------------------------------------------------------------------- profiler
def _profile(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    import mori.cpp
    import mori.kernel_profiler
    from mori_core.ops import EpDispatchCombineOp

    _init_shmem()
    dev = rank_device(rank, world)
    cfg = _config(rank, world, 2048, 64, 16 // world, 4)
    op = EpDispatchCombineOp(cfg)
    mine = _inputs(40, world, [64] * world, 2048, 16, 4, torch.bfloat16, 0, False, dev)[rank]
    op.dispatch_standard_moe(mine["x"], mine["w"], None, mine["idx"])  # allocate the layout first
    torch.cuda.synchronize()
    dist.barrier()
    op.reset_debug_time_buf()
    out, out_w, _, _, total = op.dispatch(mine["x"], mine["w"], None, mine["idx"])
    op.combine(out, out_w, mine["idx"])
    px, cnt, _, _ = op.dispatch_standard_moe(mine["x"], mine["w"], None, mine["idx"])
    op.combine_standard_moe(px, None, mine["idx"])
    torch.cuda.synchronize()
    op.check_error()
    buf = mori.cpp.get_debug_time_buf(op._handle)  # MORI's call
    assert buf.dtype == torch.int64 and buf.is_cuda
    path = os.path.join(out_dir if rank == 0 else tempfile.gettempdir(), f"ep_trace_rank{rank}.json")
    n = mori.kernel_profiler.export_to_perfetto(buf, path, rank=rank)
    doc = json.load(open(path))
    ev = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert n == len(ev) > 0
    by = {}
    for e in ev:
        by.setdefault(e["name"], []).append(e)
    need = ["dispatch_route", "dispatch_copy", "dispatch_signal", "combine_stage", "combine_barrier", "combine_reduce",
            "std_plan", "std_expand", "std_expand_base", "std_expand_first", "std_expand_items"]
    missing = [p for p in need if p not in by]
    assert not missing, f"rank {rank}: phases missing from the trace: {missing}; present: {sorted(by)}"
    # Calls in stream order: plain dispatch (dispatch round d), plain combine (combine round c),
    # standard-MoE plan + dispatch (round d + 1; the fused dispatch plans inside its own kernel,
    # so a block's plan may end after another's route began), standard-MoE combine (round c + 1).
    d = min(e["args"]["round"] for e in by["dispatch_route"])
    c = min(e["args"]["round"] for e in by["combine_stage"])

    def span(names, rnd):
        sel = [e for n in names for e in by.get(n, []) if e["args"]["round"] == rnd]
        assert sel, f"rank {rank}: no {names} events of round {rnd}"
        return min(e["ts"] for e in sel), max(e["ts"] + e["dur"] for e in sel)

    calls = [
        ("dispatch", span(["dispatch_route", "dispatch_copy", "dispatch_signal"], d)),
        ("combine", span(["combine_stage", "combine_barrier", "combine_reduce"], c)),
        ("std dispatch", span(["std_plan", "dispatch_route", "dispatch_copy", "dispatch_signal", "std_expand"], d + 1)),
        ("std combine", span(["combine_stage", "combine_barrier", "combine_reduce"], c + 1)),
    ]
    for (na, (_, end_a)), (nb, (begin_b, _)) in zip(calls, calls[1:]):
        assert end_a <= begin_b, f"rank {rank}: {na} ends at {end_a} us after {nb} starts at {begin_b} us"
    for e in ev:
        assert e["dur"] >= 0
    # per warp: route before copy, stage before barrier before reduce (same round)
    def firsts(name):
        return {(e["tid"], e["args"]["round"]): e["ts"] for e in by[name]}
    for a, b in (("dispatch_route", "dispatch_copy"), ("combine_stage", "combine_barrier"), ("combine_barrier", "combine_reduce"),
                 ("std_expand", "std_expand_base"), ("std_expand_base", "std_expand_items"),
                 ("std_expand_items", "std_expand_first")):
        fa, fb = firsts(a), firsts(b)
        for key in set(fa) & set(fb):
            assert fa[key] <= fb[key], f"rank {rank}: {a} after {b} on track {key}"
    summary = {name: {"events": len(v), "mean_us": sum(x["dur"] for x in v) / len(v)} for name, v in by.items()}
    print(f"[rank {rank}] profiler phases: {json.dumps(summary)}", flush=True)
    op.close()
    dist.barrier()
    import mori_core.shmem as shmem

    shmem.shmem_finalize()


@pytest.mark.parametrize("world", WORLDS)
def test_profiler_trace_has_ordered_dispatch_and_combine_phases(world: int) -> None:
    import mori_core

    if not mori_core.build_info().get("profiler"):
        pytest.skip("needs a build with -DMORI_ENABLE_PROFILER=ON (tools/gpu/ep15.sh builds one)")
    _need(world)
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp()
    run_ranks(_profile, world, backend="nccl", timeout=200, env={"MORI_SHMEM_HEAP_SIZE": "4G"}, out_dir=out_dir)


def _no_profiler(rank: int, world: int) -> None:
    from mori_core.ops import EpDispatchCombineOp

    _init_shmem()
    op = EpDispatchCombineOp(_config(rank, world, 256, 8, 2, 1))  # any world size
    with pytest.raises(RuntimeError, match="MORI_ENABLE_PROFILER"):
        op.get_debug_time_buf()
    op.close()
    import mori_core.shmem as shmem

    shmem.shmem_finalize()


def test_profiler_absent_in_normal_builds_says_how_to_enable() -> None:
    import mori_core

    if mori_core.build_info().get("profiler"):
        pytest.skip("this is a profiler build")
    _need(1)
    run_ranks(_no_profiler, 1, backend="nccl", timeout=120)
