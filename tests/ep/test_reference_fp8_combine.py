"""CPU tests of FP8 combine (quant_type fp8_direct_cast / fp8_blockwise) on the reference op.

The oracle re-derives the documented numerics token by token (mori_core/ops/combine_quant.py):
every row a rank returns (to another rank or to itself) is quantised to e4m3 (blockwise: scale =
amax / 448 per 128 channels, q = e4m3(x * (1 / scale)), value q * scale); the receiver adds them in
float32 in ascending rank order and rounds once to bf16. The GPU kernels must give the
same bytes (tests/ep/test_gpu_ep_extensions.py compares them with this reference op).
"""

from __future__ import annotations

import pytest
import torch

from ep_dist_utils import combine_input, rank_inputs, run_ranks, unique_dest_ranks
from mori_core.ops import EpDispatchCombineConfig, ReferenceEpDispatchCombineOp
from mori_core.ops.combine_quant import decode_rows, encode_rows, link_bytes_per_row

HIDDEN = 256


def _oracle_fp8_value(row: torch.Tensor, quant: str) -> torch.Tensor:
    """float32 values the receiver adds for one bf16 row, computed block by block."""
    x = row.to(torch.float32)
    if quant == "fp8_direct_cast":
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    out = torch.empty_like(x)
    for b in range(0, x.numel(), 128):
        blk = x[b : b + 128]
        amax = blk.abs().max()
        scale = amax / torch.tensor(448.0) if float(amax) > 0 else torch.tensor(1.0)
        inv = torch.tensor(1.0) / scale
        q = (blk * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
        out[b : b + 128] = q * scale
    return out


def _fp8_roundtrip(rank: int, world: int, quant: str, push: bool, empty_rank: int = -1) -> None:
    epr, topk, max_tok = 3, 3, 16
    cfg = EpDispatchCombineConfig(
        data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=HIDDEN, scale_dim=0, scale_type_size=4,
        max_token_type_size=2, max_num_inp_token_per_rank=max_tok, num_experts_per_rank=epr,
        num_experts_per_token=topk, use_external_inp_buf=push, quant_type=quant,
    )
    op = ReferenceEpDispatchCombineOp(cfg)
    counts = [0 if r == empty_rank else max_tok - 3 * r for r in range(world)]  # an empty rank sends nothing
    data = [rank_inputs(21, r, counts[r], HIDDEN, epr * world, topk, torch.bfloat16) for r in range(world)]
    mine = data[rank]
    out, out_w, _, _, total = op.dispatch(mine["x"], mine["weights"], None, mine["indices"])
    n = int(total[0])
    # Experts: rank r returns x * (r + 1) * 37.5 (values well above 1, some saturate the direct cast).
    y = (out[:n].to(torch.float32) * ((rank + 1) * 37.5)).to(torch.bfloat16)
    comb, comb_w = op.combine(combine_input(op, y, push), out_w, mine["indices"])
    exact = 0
    for t in range(counts[rank]):
        acc = torch.zeros(HIDDEN)
        for r in unique_dest_ranks(mine["indices"][t].tolist(), epr * world, epr):
            row = (mine["x"][t].to(torch.float32) * ((r + 1) * 37.5)).to(torch.bfloat16)
            acc = acc + _oracle_fp8_value(row, quant)
        want = acc.to(torch.bfloat16)
        assert torch.equal(comb[t].view(torch.int16), want.view(torch.int16)), (
            f"token {t}: max |diff| {(comb[t].float() - want.float()).abs().max().item()}")
        exact += 1
        # weights are never quantised
        assert torch.allclose(comb_w[t], mine["weights"][t] * len(unique_dest_ranks(mine["indices"][t].tolist(), epr * world, epr)))
    assert exact == counts[rank]


@pytest.mark.parametrize(
    "world,quant,push,empty_rank",
    [
        (1, "fp8_blockwise", True, -1),
        (1, "fp8_blockwise", False, 0),  # nothing received: 0 rows to quantise
        (2, "fp8_direct_cast", True, -1),
        (2, "fp8_blockwise", False, 1),
        (4, "fp8_blockwise", True, 2),
        (4, "fp8_direct_cast", False, -1),
    ],
)
def test_reference_fp8_combine_numerics(world: int, quant: str, push: bool, empty_rank: int) -> None:
    run_ranks(_fp8_roundtrip, world, backend="gloo", timeout=240, quant=quant, push=push, empty_rank=empty_rank)


def test_encoded_row_layout_and_link_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(3, HIDDEN, generator=g) * 10).to(torch.bfloat16)
    rows[1, :128] = 0  # an all-zero block takes scale 1
    enc = encode_rows(rows, 2)
    assert enc.shape == (3, 2 * HIDDEN) and enc.dtype == torch.uint8
    scales = enc[:, HIDDEN : HIDDEN + 8].contiguous().view(torch.float32)
    assert float(scales[1, 0]) == 1.0
    amax = rows[0, 128:].float().abs().max()
    assert float(scales[0, 1]) == float(amax / torch.tensor(448.0))
    assert torch.count_nonzero(enc[:, HIDDEN + 8 :]) == 0
    back = decode_rows(enc, HIDDEN, 2)
    rel = (back - rows.float()).norm() / rows.float().norm()
    assert 0 < rel < 0.05
    for i in range(3):
        assert torch.equal(back[i], _oracle_fp8_value(rows[i], "fp8_blockwise"))
    assert torch.equal(decode_rows(encode_rows(rows, 1), HIDDEN, 1)[2], _oracle_fp8_value(rows[2], "fp8_direct_cast"))
    assert encode_rows(rows[:0], 2).shape == (0, 2 * HIDDEN) and decode_rows(encode_rows(rows[:0], 2), HIDDEN, 2).numel() == 0
    assert link_bytes_per_row(7168, 2, 0) == 14336
    assert link_bytes_per_row(7168, 2, 1) == 7168
    assert link_bytes_per_row(7168, 2, 2) == 7168 + 4 * 56


def test_fp8_combine_argument_checks() -> None:
    base = dict(data_type=torch.bfloat16, rank=0, world_size=1, hidden_dim=HIDDEN, scale_dim=0, scale_type_size=4,
                max_token_type_size=4, max_num_inp_token_per_rank=4, num_experts_per_rank=2, num_experts_per_token=1)
    with pytest.raises(NotImplementedError, match="fp4_blockwise"):
        ReferenceEpDispatchCombineOp(EpDispatchCombineConfig(**base, quant_type="fp4_blockwise"))
    op = ReferenceEpDispatchCombineOp(EpDispatchCombineConfig(**base, quant_type="fp8_blockwise"))
    x = torch.ones(2, HIDDEN, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, dtype=torch.int32)
    op.dispatch(x, None, None, idx)
    with pytest.raises(ValueError, match="bf16"):
        op.combine(x.float(), None, idx)
    with pytest.raises(ValueError, match="multiple of 128"):
        op.combine(x[:, :96].contiguous(), None, idx)
