"""CPU tests of the inter-node kernel types (CI, no GPU): config rules, MORI's AUTO table, the
op routing and its errors, and the reference op's hierarchical semantics over gloo at world
sizes 8 and 16 with 4 and 8 GPUs per node, against an independent loop oracle."""

from __future__ import annotations

import pytest
import torch

import mori_core
from ep_dist_utils import rank_inputs, run_ranks, unique_dest_ranks
from mori_core.ops import (
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineOp,
    ReferenceEpDispatchCombineOp,
    decode_src_token_pos,
)
from mori_core.ops.launch_config import resolve_internode

INTER = ("InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL")


def _cfg(**kw) -> EpDispatchCombineConfig:
    base = dict(
        data_type=torch.bfloat16, rank=0, world_size=16, hidden_dim=64, scale_dim=0, scale_type_size=4,
        max_token_type_size=4, max_num_inp_token_per_rank=8, num_experts_per_rank=2, num_experts_per_token=4,
        kernel_type=EpDispatchCombineKernelType.InterNodeV1, gpu_per_node=8,
    )
    base.update(kw)
    return EpDispatchCombineConfig(**base)


def test_kernel_type_names_and_values_are_moris() -> None:
    assert [int(EpDispatchCombineKernelType[k]) for k in INTER] == [1, 2, 3, 4]


def test_internode_config_rules() -> None:
    _cfg().validate()
    _cfg(world_size=64, gpu_per_node=8).validate()
    with pytest.raises(ValueError, match="gpu_per_node=8 must be <= 8 and divide world_size=12"):
        _cfg(world_size=12).validate()
    with pytest.raises(ValueError, match="gpu_per_node=16"):
        _cfg(world_size=32, gpu_per_node=16).validate()
    with pytest.raises(ValueError, match="world_size=128 exceeds 64"):
        _cfg(world_size=128).validate()
    with pytest.raises(ValueError, match="num_qp_per_pe"):
        _cfg(num_qp_per_pe=0).validate()


def test_auto_launch_table_is_moris_and_explicit_values_win() -> None:
    args = dict(config_block_num=80, config_rdma_block_num=0, config_warp_per_block=8)
    assert resolve_internode("InterNodeV1", -1, -1, -1, mode="AUTO", **args) == (96, 64, 8)
    assert resolve_internode("InterNodeV1LL", -1, -1, -1, mode="AUTO", **args) == (96, 64, 8)
    assert resolve_internode("InterNode", -1, -1, -1, mode="AUTO", **args) == (128, 0, 16)
    assert resolve_internode("AsyncLL", -1, -1, -1, mode="AUTO", **args) == (128, 0, 16)
    assert resolve_internode("InterNodeV1", -1, -1, -1, mode="MANUAL", **args) == (80, 0, 8)
    assert resolve_internode("InterNodeV1", 32, 16, 4, mode="AUTO", **args) == (32, 16, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_internode_op_is_routed_and_says_what_is_missing() -> None:
    from mori_core.ops.internode import InterNodeEpDispatchCombineOp, load_internode

    for kt in INTER:
        with pytest.raises(RuntimeError, match="GPU|NVSHMEM|internode") as err:
            EpDispatchCombineOp(_cfg(world_size=2, gpu_per_node=1, kernel_type=EpDispatchCombineKernelType[kt]))
        assert "not implemented" not in str(err.value)
    if not mori_core.build_info()["internode"]:
        with pytest.raises(RuntimeError, match="built without NVSHMEM"):
            load_internode()
    assert issubclass(InterNodeEpDispatchCombineOp, EpDispatchCombineOp)


def _hierarchical_oracle(rows_by_rank: dict[int, torch.Tensor], gpn: int, dtype: torch.dtype) -> torch.Tensor:
    """Independent definition: per node an fp32 sum in ascending rank order rounded once to
    dtype, then the node partials summed in fp32 in ascending node order, rounded once."""
    nodes = sorted({r // gpn for r in rows_by_rank})
    acc = None
    for node in nodes:
        part = None
        for r in sorted(x for x in rows_by_rank if x // gpn == node):
            v = rows_by_rank[r].to(torch.float32)
            part = v if part is None else part + v
        part = part.to(dtype).to(torch.float32)
        acc = part if acc is None else acc + part
    return acc.to(dtype)


def _internode_roundtrip(rank: int, world: int, gpn: int, kernel_type: str, dtype: torch.dtype, push: bool) -> None:
    g = torch.Generator().manual_seed(world * 7 + gpn)
    max_tok, hidden, topk, epr = 12, 32, 6, 2
    counts = torch.randint(0, max_tok + 1, (world,), generator=g).tolist()
    counts[3 % world] = 0
    num_experts = epr * world
    cfg = EpDispatchCombineConfig(
        data_type=dtype, rank=rank, world_size=world, hidden_dim=hidden, scale_dim=2, scale_type_size=4,
        max_token_type_size=4, max_num_inp_token_per_rank=max_tok, num_experts_per_rank=epr,
        num_experts_per_token=topk, use_external_inp_buf=push, gpu_per_node=gpn,
        kernel_type=EpDispatchCombineKernelType[kernel_type],
    )
    op = ReferenceEpDispatchCombineOp(cfg)
    data = [rank_inputs(world, r, counts[r], hidden, num_experts, topk, dtype, 2) for r in range(world)]
    mine = data[rank]
    out, out_w, out_s, _, total = op.dispatch(mine["x"], mine["weights"], mine["scales"], mine["indices"])
    got = [decode_src_token_pos(cfg, int(p)) for p in op.get_dispatch_src_token_pos().tolist()]
    expected = [(s, t) for s in range(world) for t in range(counts[s])
                if rank in unique_dest_ranks(data[s]["indices"][t].tolist(), num_experts, epr)]
    assert got == expected and int(total[0]) == len(expected)
    for i, (s, t) in enumerate(got):
        assert torch.equal(out[i].view(torch.uint8), data[s]["x"][t].view(torch.uint8))
        assert torch.equal(out_s[i], data[s]["scales"][t])
    n = int(total[0])
    # experts scale by (rank + 1); fp32 inputs make the rounding of node partials visible too
    y = (out[:n].to(torch.float32) * (rank + 1) / 3).to(dtype)
    inp = torch.zeros(cfg.max_num_tokens_to_recv(), hidden, dtype=dtype) if push else \
        op.get_registered_combine_input_buffer(dtype)
    inp[:n] = y
    comb, comb_w = op.combine(inp, out_w, mine["indices"])
    for t in range(counts[rank]):
        dests = unique_dest_ranks(mine["indices"][t].tolist(), num_experts, epr)
        if not dests:
            assert torch.count_nonzero(comb[t]) == 0
            continue
        rows = {r: (mine["x"][t].to(torch.float32) * (r + 1) / 3).to(dtype) for r in dests}
        want = _hierarchical_oracle(rows, gpn, dtype)
        assert torch.equal(comb[t].view(torch.uint8), want.view(torch.uint8)), f"token {t} dests {dests}"
        wsum = None
        for node in sorted({r // gpn for r in dests}):
            part = None
            for r in [d for d in dests if d // gpn == node]:
                part = mine["weights"][t].clone() if part is None else part + mine["weights"][t]
            wsum = part if wsum is None else wsum + part
        assert torch.equal(comb_w[t], wsum)


@pytest.mark.parametrize(
    "world,gpn,kernel_type,dtype,push",
    [
        (8, 4, "InterNodeV1", torch.bfloat16, True),
        (8, 4, "AsyncLL", torch.float32, False),
        (16, 8, "InterNodeV1LL", torch.bfloat16, False),
    ],
)
def test_reference_internode_hierarchical(world: int, gpn: int, kernel_type: str, dtype: torch.dtype,
                                          push: bool) -> None:
    run_ranks(_internode_roundtrip, world, backend="gloo", timeout=300, gpn=gpn, kernel_type=kernel_type,
              dtype=dtype, push=push)


def test_network_path_switches_are_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """MORI_EP_INTERNODE_PATH (auto / put) and MORI_EP_INTERNODE_PUT_ROWS, read when an op is
    created: defaults, accepted values, and errors naming the variable and what it accepts."""
    from mori_core.ops.internode import PATH_ENV, PUT_ROWS_ENV, network_path_from_env

    monkeypatch.delenv(PATH_ENV, raising=False)
    monkeypatch.delenv(PUT_ROWS_ENV, raising=False)
    assert network_path_from_env(128) == (False, 1)
    monkeypatch.setenv(PATH_ENV, "PUT")
    monkeypatch.setenv(PUT_ROWS_ENV, "128")
    assert network_path_from_env(128) == (True, 128)
    monkeypatch.setenv(PATH_ENV, "nic")
    with pytest.raises(ValueError, match=r"MORI_EP_INTERNODE_PATH='nic' must be one of auto, put"):
        network_path_from_env(128)
    monkeypatch.setenv(PATH_ENV, "auto")
    for bad in ("0", "129", "-1", "x"):
        monkeypatch.setenv(PUT_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=rf"MORI_EP_INTERNODE_PUT_ROWS='{bad}' must be an integer in \[1, "
                                             r"max_num_inp_token_per_rank=128\]"):
            network_path_from_env(128)


def test_bench_pairs_each_row_with_deepeps_of_the_same_shape(capsys: pytest.CaptureFixture) -> None:
    """The benchmark's side-by-side table puts each of our low-latency rows next to the DeepEP
    low-latency row of the same operation, dtype and token count, and only those."""
    from mori_core.bench.ep.deepep_ll import ll_tokens
    from mori_core.bench.ep.internode import _print_side_by_side
    from mori_core.bench.table import print_table

    ours = [dict(kernel="InterNodeV1LL [auto] dispatch", dtype="fp8", tokens=128, eager_us=30.0, host_us=9.0),
            dict(kernel="InterNodeV1LL [put] combine", dtype="bf16", tokens=128, eager_us=90.0, host_us=8.0),
            dict(kernel="InterNode [auto] dispatch", dtype="bf16", tokens=4096, eager_us=500.0, host_us=9.0),
            dict(kernel="InterNodeV1 [auto] dispatch", dtype="fp8", tokens=128, eager_us=30.0, host_us=9.0),
            dict(kernel="nccl a2a (dispatch)", dtype="bf16", tokens=128, eager_us=80.0, host_us=20.0)]
    deepep = [dict(kernel="DeepEP LL dispatch", dtype="fp8", tokens=128, eager_us=40.0, host_us=30.0, kernel_us=35.0),
              dict(kernel="DeepEP LL combine", dtype="bf16", tokens=128, eager_us=60.0, host_us=25.0, kernel_us=None)]
    _print_side_by_side(ours, deepep, print_table)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and "ours us" not in ln]
    assert len(lines) == 2
    assert "InterNodeV1LL [auto] dispatch" in lines[0] and "0.75" in lines[0] and "35.0" in lines[0]
    assert "InterNodeV1LL [put] combine" in lines[1] and "1.50" in lines[1]
    assert ll_tokens("128,512,4096") == [128, 512]


def test_gpu_test_plan_covers_every_type_on_every_path() -> None:
    """The GPU test's plan (test_gpu_internode._plan): a split configuration runs every type once
    and both paths; 8x1 + 8x4 split together run every (type, path); unsplit ones run all pairs."""
    from test_gpu_internode import TYPES, _plan

    paths = ("auto", "put")
    full = _plan(4, [1, 2], paths, TYPES, ("4x2",))
    assert {(p, kt) for g, p, sel in full if g == 1 for kt in sel} == {(p, kt) for p in paths for kt in TYPES}
    four_two = [(p, kt) for g, p, sel in full if g == 2 for kt in sel]
    assert sorted(kt for _, kt in four_two) == sorted(TYPES) and {p for p, _ in four_two} == set(paths)
    eight = _plan(8, [1, 4], paths, TYPES, ("8x1", "8x4"))
    pairs = [(p, kt) for _, p, sel in eight for kt in sel]
    assert sorted(pairs) == sorted((p, kt) for p in paths for kt in TYPES)
    assert all({p for g2, p, _ in eight if g2 == g} == set(paths) for g in (1, 4))


def test_bench_token_counts_per_kind_and_the_intranode_ratio(capsys: pytest.CaptureFixture) -> None:
    """--ll-tokens limits the low-latency types (and must be a subset of --tokens); the throughput
    table puts InterNode/InterNodeV1 next to IntraNode of the same shape: ratio = IntraNode us / ours."""
    import argparse

    from mori_core.bench.ep.internode import _print_vs_intranode, kind_tokens
    from mori_core.bench.table import print_table

    args = argparse.Namespace(tokens="128,512,4096", ll_tokens="128,512")
    assert kind_tokens("AsyncLL", args) == [128, 512] and kind_tokens("InterNodeV1LL", args) == [128, 512]
    assert kind_tokens("InterNode", args) == [128, 512, 4096] and kind_tokens("IntraNode", args) == [128, 512, 4096]
    assert kind_tokens("AsyncLL", argparse.Namespace(tokens="128", ll_tokens="")) == [128]
    with pytest.raises(ValueError, match="--ll-tokens"):
        kind_tokens("AsyncLL", argparse.Namespace(tokens="128", ll_tokens="256"))
    merged = [dict(kernel="InterNodeV1 [put] dispatch", dtype="fp8", tokens=4096, eager_us=400.0, host_us=9.0),
              dict(kernel="AsyncLL [auto] dispatch", dtype="fp8", tokens=4096, eager_us=400.0, host_us=9.0),
              dict(kernel="IntraNode dispatch", dtype="fp8", tokens=4096, eager_us=300.0, host_us=8.0),
              dict(kernel="IntraNode combine", dtype="bf16", tokens=4096, eager_us=500.0, host_us=8.0)]
    _print_vs_intranode(merged, print_table)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and "inter-node kernel" not in ln]
    assert len(lines) == 1 and "InterNodeV1 [put] dispatch" in lines[0] and "0.75" in lines[0]
