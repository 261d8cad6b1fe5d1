"""CPU tests of ReferenceEpDispatchCombineOp over gloo (world sizes 1, 2, 4, 8).

The oracle here is independent of the reference: every rank regenerates all ranks' inputs from
the seed and derives the expected receive set, payloads and combine sums with plain loops.
"""

from __future__ import annotations

import functools

import pytest
import torch

from ep_dist_utils import rank_inputs, run_ranks, single_rank_config, unique_dest_ranks
from mori_core.ops import (
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    ReferenceEpDispatchCombineOp,
    decode_src_token_pos,
)


def _token_counts(seed: int, world: int, max_tok: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_tok + 1, (world,), generator=g).tolist()
    counts[seed % world] = 0  # always one rank with no tokens
    if world > 1:
        counts[(seed + 1) % world] = max_tok  # and one at capacity
    return counts


def _roundtrip(
    rank: int,
    world: int,
    seed: int,
    hidden: int,
    topk: int,
    experts_per_rank: int,
    max_tok: int,
    dtype: torch.dtype,
    scale_dim: int,
    push: bool,
    rounds: int = 2,
) -> None:
    counts = _token_counts(seed, world, max_tok)
    num_experts = experts_per_rank * world
    cfg = EpDispatchCombineConfig(
        data_type=dtype,
        rank=rank,
        world_size=world,
        hidden_dim=hidden,
        scale_dim=scale_dim,
        scale_type_size=4,
        max_token_type_size=4,
        max_num_inp_token_per_rank=max_tok,
        num_experts_per_rank=experts_per_rank,
        num_experts_per_token=topk,
        use_external_inp_buf=push,
    )
    op = ReferenceEpDispatchCombineOp(cfg)
    for rnd in range(rounds):
        data = [
            rank_inputs(seed + 17 * rnd, r, counts[r], hidden, num_experts, topk, dtype, scale_dim)
            for r in range(world)
        ]
        mine = data[rank]
        out, out_w, out_s, out_idx, total = op.dispatch(
            mine["x"], mine["weights"], mine["scales"], mine["indices"], call_local_expert_count=True
        )
        cap = cfg.max_num_tokens_to_recv()
        assert out.shape == (cap, hidden) and out.dtype == dtype
        assert out_w.shape == (cap, topk) and out_w.dtype == torch.float32
        assert out_idx.shape == (cap, topk) and out_idx.dtype == torch.int32
        assert total.shape == (1,) and total.dtype == torch.int32
        assert (out_s is None) == (scale_dim == 0)

        expected = [
            (s, t)
            for s in range(world)
            for t in range(counts[s])
            if rank in unique_dest_ranks(data[s]["indices"][t].tolist(), num_experts, experts_per_rank)
        ]
        n_recv = int(total[0])
        assert n_recv == len(expected)
        pos = op.get_dispatch_src_token_pos()
        got = [decode_src_token_pos(cfg, int(p)) for p in pos.tolist()]
        assert got == expected  # the reference's documented order: by source rank, then token
        local_count = torch.zeros(experts_per_rank, dtype=torch.int32)
        for i, (s, t) in enumerate(got):
            assert torch.equal(out[i].view(torch.uint8), data[s]["x"][t].view(torch.uint8))
            assert torch.equal(out_w[i], data[s]["weights"][t])
            assert torch.equal(out_idx[i], data[s]["indices"][t])
            if scale_dim:
                assert torch.equal(out_s[i], data[s]["scales"][t])
            for e in data[s]["indices"][t].tolist():
                if rank * experts_per_rank <= e < (rank + 1) * experts_per_rank:
                    local_count[e - rank * experts_per_rank] += 1
        assert torch.equal(op.local_expert_count, local_count)

        # "Experts": scale every received row by (rank + 1), so each source rank contributes a
        # distinguishable amount to the sum.
        comb_dtype = torch.bfloat16 if dtype.itemsize == 1 else dtype
        y = (out[:n_recv].to(torch.float32) * (rank + 1)).to(comb_dtype)
        if push:
            inp = torch.zeros(cap, hidden, dtype=comb_dtype)
            inp[:n_recv] = y
        else:
            inp = op.get_registered_combine_input_buffer(comb_dtype)
            inp[:n_recv] = y
        comb, comb_w = op.combine(inp, out_w, mine["indices"], call_reset=True)
        assert comb.shape == (max_tok, hidden) and comb.dtype == comb_dtype
        assert comb_w.shape == (max_tok, topk)
        for t in range(counts[rank]):
            dests = unique_dest_ranks(mine["indices"][t].tolist(), num_experts, experts_per_rank)
            acc = torch.zeros(hidden)
            for r in dests:
                acc += (mine["x"][t].to(torch.float32) * (r + 1)).to(comb_dtype).to(torch.float32)
            torch.testing.assert_close(comb[t].to(torch.float32), acc.to(comb_dtype).to(torch.float32), rtol=0, atol=0)
            torch.testing.assert_close(comb_w[t], mine["weights"][t] * len(dests), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "world,dtype,scale_dim,push",
    [
        (1, torch.bfloat16, 0, True),
        (2, torch.bfloat16, 0, False),
        (2, torch.float8_e4m3fn, 4, True),
        (4, torch.float32, 2, False),
        (4, torch.bfloat16, 0, True),
        (8, torch.bfloat16, 3, False),
    ],
)
def test_reference_roundtrip(world: int, dtype: torch.dtype, scale_dim: int, push: bool) -> None:
    run_ranks(
        _roundtrip,
        world,
        backend="gloo",
        timeout=240,
        seed=7 + world,
        hidden=64,
        topk=4 if world < 8 else 8,
        experts_per_rank=4,
        max_tok=24,
        dtype=dtype,
        scale_dim=scale_dim,
        push=push,
        rounds=1 if world == 8 else 2,  # world 8 spawns 8 processes: keep CI time down
    )


def _overflow(rank: int, world: int) -> None:
    cfg = EpDispatchCombineConfig(
        data_type=torch.bfloat16,
        rank=rank,
        world_size=world,
        hidden_dim=16,
        scale_dim=0,
        scale_type_size=4,
        max_token_type_size=2,
        max_num_inp_token_per_rank=8,
        num_experts_per_rank=2,
        num_experts_per_token=1,
        max_total_recv_tokens=4,  # 2 per source rank
    )
    op = ReferenceEpDispatchCombineOp(cfg)
    x = torch.ones(8, 16, dtype=torch.bfloat16)
    idx = torch.zeros(8, 1, dtype=torch.int32)  # everything to expert 0 on rank 0
    with pytest.raises(RuntimeError, match="max_total_recv_tokens"):
        op.dispatch(x, None, None, idx)


def test_reference_overflow_is_reported_on_every_rank() -> None:
    run_ranks(_overflow, 2, backend="gloo", timeout=120)


# Hidden 32 with 2 scale columns: the shapes the validation tests below pass.
_single_rank_config = functools.partial(single_rank_config, hidden_dim=32, scale_dim=2)


def test_reference_validation_names_the_argument() -> None:
    op = ReferenceEpDispatchCombineOp(_single_rank_config())
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    w = torch.zeros(4, 2)
    s = torch.zeros(4, 2)
    idx = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices must be torch.int32"):
        op.dispatch(x, w, s, idx.long())
    with pytest.raises(ValueError, match="max_num_inp_token_per_rank=8"):
        op.dispatch(torch.zeros(9, 32, dtype=torch.bfloat16), None, None, torch.zeros(9, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="hidden_dim=32"):
        op.dispatch(torch.zeros(4, 64, dtype=torch.bfloat16), w, s, idx)
    with pytest.raises(ValueError, match="weights must have shape"):
        op.dispatch(x, torch.zeros(4, 3), s, idx)
    with pytest.raises(ValueError, match="weights must be torch.float32"):
        op.dispatch(x, w.double(), s, idx)
    with pytest.raises(ValueError, match="scales must have shape"):
        op.dispatch(x, w, torch.zeros(4, 5), idx)
    with pytest.raises(ValueError, match="scale_type_size=4"):
        op.dispatch(x, w, s.half(), idx)
    with pytest.raises(ValueError, match="max_token_type_size=2"):
        op.dispatch(x.float(), w, s, idx)
    with pytest.raises(ValueError, match="contiguous"):
        op.dispatch(torch.zeros(32, 4, dtype=torch.bfloat16).t(), w, s, idx)
    with pytest.raises(ValueError, match="block_num"):
        op.dispatch(x, w, s, idx, block_num=-5)
    with pytest.raises(RuntimeError, match="preceding dispatch"):
        op.combine(x, w, idx)
    op.dispatch(x, w, s, idx)
    with pytest.raises(ValueError, match=r"shape \[4, 2\]"):
        op.combine(x, w, idx[:3])
    with pytest.raises(ValueError, match="different set of ranks"):
        op.combine(x, w, torch.full((4, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="use_external_inp_buf"):
        op.combine(x, w, idx, use_external_inp_buf=3)
    with pytest.raises(ValueError, match="rows"):
        op.combine(x[:2], w, idx, use_external_inp_buf=1)


def test_reference_world1_drops_invalid_experts_and_keeps_capacity_shapes() -> None:
    cfg = _single_rank_config(scale_dim=0)
    op = ReferenceEpDispatchCombineOp(cfg)
    x = torch.randn(3, 32).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [-1, -1], [2, 99]], dtype=torch.int32)  # token 1: no valid expert
    out, out_w, out_s, out_idx, total = op.dispatch(x, None, None, idx)
    assert int(total[0]) == 2 and out.shape == (8, 32) and out_s is None
    assert op.get_dispatch_src_token_pos().tolist() == [0, 2]
    comb, comb_w = op.combine(out, None, idx)
    assert comb_w is None
    assert torch.equal(comb[0], x[0]) and torch.equal(comb[2], x[2])
    assert torch.count_nonzero(comb[1]) == 0  # a token that went nowhere combines to zeros


def test_config_validation_and_derived_sizes() -> None:
    cfg = _single_rank_config(world_size=4, rank=3, max_total_recv_tokens=10)
    cfg.validate()
    assert cfg.max_num_tokens_to_recv_per_rank() == 3 and cfg.max_num_tokens_to_recv() == 12
    assert cfg.max_num_tokens_to_send() == 32
    with pytest.raises(ValueError, match="rank=4"):
        _single_rank_config(world_size=4, rank=4).validate()
    with pytest.raises(ValueError, match="world_size=16 exceeds 8"):
        _single_rank_config(world_size=16).validate()
    with pytest.raises(ValueError, match="gpu_per_node"):
        _single_rank_config(gpu_per_node=3).validate()
    with pytest.raises(ValueError, match="quant_type"):
        _single_rank_config(quant_type="int3").validate()
    assert EpDispatchCombineKernelType.IntraNode == 0 and EpDispatchCombineKernelType.IntraNodeLL == 5
