"""CPU tests of the standard-MoE (3-D, DeepEP-layout) API of ReferenceEpDispatchCombineOp over
gloo, world sizes 1, 2, 4 and 8.

The oracle is independent of the reference: every rank regenerates all ranks' inputs and derives,
with plain loops, each local expert's rows in (source rank, source token) order, the counts,
source infos and layout ranges, and the combine sums (per destination rank: the gating-weighted sum
of its experts' outputs rounded to bf16; then the fp32 sum over ranks rounded once).
"""

from __future__ import annotations

import pytest
import torch

from ep_dist_utils import rank_inputs, run_ranks
from mori_core.ops import EpDispatchCombineConfig, ReferenceEpDispatchCombineOp


def _config(rank: int, world: int, hidden: int, topk: int, epr: int, max_tok: int, scale_dim: int) -> EpDispatchCombineConfig:
    return EpDispatchCombineConfig(
        data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=hidden, scale_dim=scale_dim,
        scale_type_size=4, max_token_type_size=2, max_num_inp_token_per_rank=max_tok,
        num_experts_per_rank=epr, num_experts_per_token=topk,
    )


def _with_duplicates(data: dict, topk: int) -> dict:
    """Let a few tokens list one expert twice (the layout gives it one row; both weights apply)."""
    idx = data["indices"].clone()
    for t in range(0, idx.shape[0], 5):
        if topk > 1 and idx[t, 0] >= 0:
            idx[t, topk - 1] = idx[t, 0]
    return {**data, "indices": idx}


def _expert_out(x: torch.Tensor, e: int) -> torch.Tensor:
    """What expert e returns for rows x: x * (e + 1) / 8, rounded to bf16."""
    return (x.to(torch.float32) * ((e + 1) / 8.0)).to(torch.bfloat16)


def _std_roundtrip(rank: int, world: int, seed: int, weighted: bool, split: bool) -> None:
    hidden, topk, epr, max_tok, scale_dim = 64, 4 if world < 8 else 6, 3, 20, 2
    cfg = _config(rank, world, hidden, topk, epr, max_tok, scale_dim)
    op = ReferenceEpDispatchCombineOp(cfg)
    num_experts, T = epr * world, world * max_tok
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_tok + 1, (world,), generator=g).tolist()
    counts[seed % world] = 0
    data = [_with_duplicates(rank_inputs(seed, r, counts[r], hidden, num_experts, topk, torch.bfloat16, scale_dim), topk)
            for r in range(world)]
    mine = data[rank]
    w_in = mine["weights"] if weighted else None
    if split:  # dispatch + convert_dispatch_output
        out, _, _, out_idx, total = op.dispatch(mine["x"], w_in, mine["scales"], mine["indices"])
        n = int(total[0])
        px, cnt, info, lr = op.convert_dispatch_output(out[:n], out_idx[:n])
    else:
        px, cnt, info, lr = op.dispatch_standard_moe(mine["x"], w_in, mine["scales"], mine["indices"])
    ps = op.get_packed_recv_scales()
    assert px.shape == (epr, T, hidden) and px.dtype == torch.bfloat16
    assert cnt.shape == (epr,) and cnt.dtype == torch.int32
    assert info.shape == (epr, T) and info.dtype == torch.int32
    assert lr.shape == (epr, world) and lr.dtype == torch.int64
    assert ps.shape == (epr, T, scale_dim)

    stride = cfg.max_num_tokens_to_send()
    for el in range(epr):
        e = rank * epr + el
        expect = [(s, t) for s in range(world) for t in range(counts[s]) if e in data[s]["indices"][t].tolist()]
        assert int(cnt[el]) == len(expect), f"expert {e}: {int(cnt[el])} rows, expected {len(expect)}"
        for j, (s, t) in enumerate(expect):
            assert int(info[el, j]) == s * stride + t, f"expert {e} row {j}"
            assert torch.equal(px[el, j].view(torch.int16), data[s]["x"][t].view(torch.int16)), f"expert {e} row {j}"
            assert torch.equal(ps[el, j], data[s]["scales"][t])
        begin = 0
        for s in range(world):
            c = sum(1 for (ss, _) in expect if ss == s)
            assert int(lr[el, s]) == c | (begin << 32), f"expert {e} source {s}"
            begin += c

    # Experts: row of expert e -> x * (e + 1) / 8. Rows past the counts hold garbage (NaN).
    y = torch.full_like(px, float("nan"))
    for el in range(epr):
        c = int(cnt[el])
        y[el, :c] = _expert_out(px[el, :c], rank * epr + el)
    comb, comb_w = op.combine_standard_moe(y, None, mine["indices"], call_reset=True)
    assert comb_w is None and comb.shape == (max_tok, hidden)
    for t in range(counts[rank]):
        ids, w = mine["indices"][t].tolist(), mine["weights"][t]
        acc = torch.zeros(hidden)
        for r in range(world):
            part = torch.zeros(hidden)
            hit = False
            for k, e in enumerate(ids):
                if 0 <= e < num_experts and e // epr == r:
                    term = _expert_out(mine["x"][t], e).to(torch.float32)
                    part = part + (term * w[k] if weighted else term)
                    hit = True
            if hit:
                acc = acc + part.to(torch.bfloat16).to(torch.float32)
        got, want = comb[t].to(torch.float32), acc.to(torch.bfloat16).to(torch.float32)
        assert torch.equal(got, want), f"token {t}: max |diff| {(got - want).abs().max().item()}"


@pytest.mark.parametrize(
    "world,weighted,split",
    [(1, True, False), (2, True, False), (2, False, True), (4, True, True), (8, True, False)],
)
def test_reference_standard_moe(world: int, weighted: bool, split: bool) -> None:
    run_ranks(_std_roundtrip, world, backend="gloo", timeout=240, seed=11 + world, weighted=weighted, split=split)


def _converters_agree_with_combine(rank: int, world: int) -> None:
    """combine_standard_moe == combine(convert_combine_input(...)), and a stale layout is refused."""
    cfg = _config(rank, world, 32, 3, 2, 12, 0)
    op = ReferenceEpDispatchCombineOp(cfg)
    data = [rank_inputs(5, r, 9 + r, 32, 2 * world, 3, torch.bfloat16) for r in range(world)]
    mine = data[rank]
    px, cnt, _, _ = op.dispatch_standard_moe(mine["x"], mine["weights"], None, mine["indices"])
    y = (px.to(torch.float32) * 1.5).to(torch.bfloat16)
    a, _ = op.combine_standard_moe(y, None, mine["indices"])
    rows = op.convert_combine_input(y)
    b, _ = op.combine(rows, None, mine["indices"])
    assert torch.equal(a, b)
    op.dispatch(mine["x"], mine["weights"], None, mine["indices"])
    with pytest.raises(RuntimeError, match="no standard-MoE layout of the current dispatch"):
        op.combine_standard_moe(y, None, mine["indices"])
    with pytest.raises(ValueError, match="num_experts_per_rank=2"):
        op.convert_combine_input(y[:1])


def test_reference_standard_moe_paths_agree() -> None:
    run_ranks(_converters_agree_with_combine, 2, backend="gloo", timeout=120)
