"""MORI's EPv2 API (``mori.ops.dispatch_combine_v2`` / ``mori.cco``) on CPU: the config contract
SGLang reads, and the op over a CPU communicator (mori_core's reference engine, gloo, world 2)
against a dense oracle computed independently on every rank."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from ep_dist_utils import run_ranks

from mori_core.ops.dispatch_combine_v2 import EpDispatchCombineConfig, EpDispatchCombineOp, EpDispatchRoutingHandle

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


def _cfg(**kw) -> EpDispatchCombineConfig:
    base = dict(rank=0, world_size=2, hidden_dim=256, max_num_inp_token_per_rank=16, num_experts_per_rank=4,
                num_experts_per_token=3)
    base.update(kw)
    return EpDispatchCombineConfig(**base)


# ----------------------------------------------------------------------------- config contract
def test_derived_sizes_sglang_reads() -> None:
    c = _cfg(max_total_recv_tokens=20)
    assert (c.effective_max_recv_per_rank, c.effective_max_recv, c.max_recv) == (10, 20, 32)
    assert (c.token_nbytes, c.combine_token_nbytes, c.wire_elem_size) == (512, 512, 2)
    assert (c.is_scatter, c.fp8_blockwise, c.combine_scale_dim, c.is_internode) == (False, False, 0, False)
    q = _cfg(quant_type="fp8_blockwise")
    assert (q.combine_mode, q.is_scatter, q.wire_elem_size, q.combine_scale_dim) == ("scatter", True, 1, 2)
    a = _cfg(dispatch_data_type=FP8, combine_data_type=torch.bfloat16, scale_dim=2, scale_type_size=4)
    assert (a.token_nbytes, a.combine_token_nbytes, a.dtype_str, a.scale_dwords) == (256, 512, "fp8", 2)
    f4 = _cfg(dispatch_data_type=torch.float4_e2m1fn_x2, combine_data_type=torch.bfloat16)
    assert (f4.token_nbytes, f4.is_fp4) == (128, True)
    mx = _cfg(scale_dim=256 // 32, scale_type_size=1)
    assert mx.scale_dwords == 2
    eng = a.engine_config()  # the v1 engine config behind the v2 op
    assert (eng.scale_dim, eng.scale_type_size, eng.max_token_type_size, eng.use_external_inp_buf) == (2, 4, 2, False)
    assert _cfg(gpu_per_node=1).is_internode and _cfg(gpu_per_node=1).nodes == 2


def test_geometry_pinned_fallback_and_schedule() -> None:
    c = _cfg(dispatch_block_num=32)
    assert (c.dispatch_block_num, c.combine_block_num, c.warp_num_per_block, c.combine_warp_num_per_block) == (32, 80, 16, 4)
    s = _cfg(schedule=((8, 1, 2, 3, 4), (None, 5, 6, 7, 8)))
    assert s.launch_for(8) == (1, 2, 3, 4) and s.launch_for(9) == (5, 6, 7, 8)
    t = EpDispatchCombineConfig.tuned(rank=0, world_size=2, hidden_dim=256, max_num_inp_token_per_rank=16,
                                      num_experts_per_rank=4, num_experts_per_token=3, combine_block_num=7)
    assert t.combine_block_num == 7 and t.dispatch_block_num >= 1


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dispatch_data_type=FP8), "set together"),
        (dict(quant_type="fp4_blockwise"), "quant_type must be one of"),
        (dict(combine_mode="push"), "gather|scatter"),
        (dict(hidden_dim=196), "16 B aligned"),
        (dict(dispatch_data_type=FP8, combine_data_type=torch.bfloat16, combine_mode="scatter"), "asymmetric"),
        (dict(quant_type="fp8_blockwise", hidden_dim=208), "multiple|% 128"),
        (dict(kernel_backend="cuda"), "kernel_backend"),
        (dict(world_size=9), "divide world_size=9"),
        (dict(num_experts_per_token=0), "num_experts_per_token"),
        (dict(scale_dim=4, scale_type_size=3), "scale_type_size"),
    ],
)
def test_config_errors_name_the_field(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_alias_exports_and_capability_marker() -> None:
    import mori.cco.cco as cco
    from mori.cco import Communicator
    from mori.cco.communicator import DevCommHandle
    from mori.ops.dispatch_combine_v2 import EpDispatchCombineConfig as Alias
    from mori.ops.dispatch_combine_v2 import intranode_kernels

    assert Alias is EpDispatchCombineConfig and "gpu_per_node" in Alias.__dataclass_fields__
    assert intranode_kernels._direct_cast_fp8_max == 448.0
    r = cco.DevCommRequirements()
    r.gda_connection_type = cco.GDA_CONNECTION_NONE
    assert Communicator.init and DevCommHandle


def test_communicator_needs_torch_distributed_on_cpu() -> None:
    from mori.cco import Communicator

    if torch.cuda.is_available():
        pytest.skip("a GPU machine builds the GPU communicator")
    with pytest.raises(RuntimeError, match="torch.distributed"):
        Communicator.init(2, 0, Communicator.get_unique_id())


# ----------------------------------------------------------------------------- the op over gloo
H, K, EPR, M = 256, 3, 4, 16


def _inputs(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, 2 * EPR, generator=g).topk(K, dim=1).indices.to(torch.int32)
    w = torch.rand(n, K, generator=g)
    return x, idx, w


def _expected_combine(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Identity experts: every unique destination rank returns the token, so the combine is
    ``x * unique_ranks`` and the weights ``w * unique_ranks`` (MORI's unweighted sum)."""
    x, idx, w = _inputs(rank, n)
    ranks = torch.zeros(n)
    for t in range(n):
        ranks[t] = len({int(e) // EPR for e in idx[t]})
    return (x.float() * ranks[:, None]), w * ranks[:, None]


def _op(rank: int, world: int, **kw) -> EpDispatchCombineOp:
    from mori.cco import Communicator

    uid = Communicator.get_unique_id() if rank == 0 else None
    obj = [uid]
    torch.distributed.broadcast_object_list(obj, src=0)
    comm = Communicator.init(world, rank, obj[0], per_rank_vmm=1 << 30)
    assert comm.create_dev_comm().lsa_size == world
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=EPR, num_experts_per_token=K, **kw)
    op = EpDispatchCombineOp(cfg, comm)
    comm.barrier()
    return op


def _round_trip(op: EpDispatchCombineOp, rank: int, n: int, recv_cap=None, direct=False):
    x, idx, w = _inputs(rank, n)
    kwargs = dict(return_routing=True)
    if recv_cap is not None:
        kwargs.update(recv_cap=recv_cap, clone_routing=False)
    out, ow, os_, oi, total, h = op.dispatch(x, w, None, idx, **kwargs)
    t = int(total[0])
    assert out.shape[0] == (recv_cap or op.cfg.effective_max_recv) and os_ is None
    y = op.combine_in_view()[: out.shape[0]] if direct else torch.zeros_like(out)
    y[:t].copy_(out[:t])
    comb, cw = op.combine(y, None, oi, routing=h)
    return comb, cw, h, t


def _suite(rank: int, world: int) -> None:
    # gather (pull) and scatter (push), each with recv_cap tiers and the zero-copy input view
    for mode in ("gather", "scatter"):
        op = _op(rank, world, combine_mode=mode)
        assert op.backend_name == "mori_core.reference"
        for cap, n, direct in ((None, 12, False), (32, 12, True), (M * world, M, False)):
            if cap is not None:
                op.prepare_recv_cap(cap)
            comb, cw, h, t = _round_trip(op, rank, n, recv_cap=cap, direct=direct)
            want, want_w = _expected_combine(rank, n)
            torch.testing.assert_close(comb.float(), want, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(cw, want_w)
            assert h.disp_tok_id_to_src_tok_id_local.shape == (t,)
        with pytest.raises(ValueError, match="recv_cap"):
            op.prepare_recv_cap(op.cfg.effective_max_recv + 1)
    # local_expert_count: received (row, local expert) pairs, against the senders' routing
    op = _op(rank, world)
    x, idx, w = _inputs(rank, 10)
    _, _, _, _, total, h = op.dispatch(x, w, None, idx, return_routing=True)
    lec = op.local_expert_count()
    want = torch.zeros(EPR, dtype=torch.int32)
    for src in range(world):
        for e in _inputs(src, 10)[1].flatten().tolist():
            if rank * EPR <= e < (rank + 1) * EPR:
                want[e - rank * EPR] += 1
    assert torch.equal(lec, want), (lec, want)
    # a handle of an older dispatch is refused, the latest one accepted
    _, _, _, oi, _, h2 = op.dispatch(x[:8], w[:8], None, idx[:8], return_routing=True)
    with pytest.raises(ValueError, match="latest dispatch"):
        op.combine(torch.zeros(op.cfg.effective_max_recv, H, dtype=torch.bfloat16), routing=h)
    with pytest.raises(ValueError, match="either routing"):
        op.dispatch(x, w, None, idx, routing=h2, return_routing=True)
    op.combine(torch.zeros(op.cfg.effective_max_recv, H, dtype=torch.bfloat16), routing=h2)
    # FP8 dispatch with fp32 scales and 1-byte (e8m0) scales: forwarded as int32 dwords
    for sdim, sdt in ((H // 128, torch.float32), (H // 32, E8M0)):
        op = _op(rank, world, dispatch_data_type=FP8, combine_data_type=torch.bfloat16, scale_dim=sdim,
                 scale_type_size=torch.empty(0, dtype=sdt).element_size())
        g = torch.Generator().manual_seed(7 + rank)
        xs = (torch.randn(12, H, generator=g) * 4).to(FP8)
        sc = torch.rand(12, sdim, generator=g).to(sdt) if sdt is torch.float32 else \
            torch.randint(100, 140, (12, sdim), generator=g, dtype=torch.uint8).view(sdt)
        _, idx, w = _inputs(rank, 12)
        out, _, osc, _, total, h = op.dispatch(xs, w, sc, idx, return_routing=True)
        assert osc.dtype == torch.int32 and osc.shape[1] == op.cfg.scale_dwords
        pos = h.disp_tok_id_to_src_tok_id_local
        for row, flat in enumerate(pos.tolist()):
            src, tok = divmod(flat, world * M)
            g2 = torch.Generator().manual_seed(7 + src)
            xs_src = (torch.randn(12, H, generator=g2) * 4).to(FP8)
            sc_src = torch.rand(12, sdim, generator=g2).to(sdt) if sdt is torch.float32 else \
                torch.randint(100, 140, (12, sdim), generator=g2, dtype=torch.uint8).view(sdt)
            assert torch.equal(out[row].view(torch.uint8), xs_src[tok].view(torch.uint8))
            got_sc = osc[row].view(torch.uint8)[: sdim * sc.element_size()]
            assert torch.equal(got_sc, sc_src[tok].contiguous().view(torch.uint8))
    # FP8 combine quant (scatter) against the bf16 result of the same inputs
    for quant in ("fp8_direct_cast", "fp8_blockwise"):
        op = _op(rank, world, quant_type=quant)
        assert op.cfg.is_scatter
        comb, _, _, _ = _round_trip(op, rank, 12)
        want, _ = _expected_combine(rank, 12)
        rel = (comb.float() - want).norm() / want.norm()
        assert 0 < rel < 0.08, (quant, float(rel))
    # StdMoE: per-expert layout and back (identity experts, so the weighted sum is x * sum(w))
    op = _op(rank, world, enable_std_moe=True)
    x, idx, w = _inputs(rank, 12)
    _, _, _, _, total, h = op.dispatch(x, w, None, idx, return_routing=True)
    px, cnt, src = op.convert_dispatch_output()
    assert px.shape == (EPR, world * M, H) and int(cnt.sum()) == int(op.local_expert_count().sum())
    view = op.convert_combine_input(h)
    assert view.data_ptr() == op.combine_in_view().data_ptr()
    comb, _ = op.combine(view, None, None, routing=h)
    want = torch.zeros(12, H)
    for t in range(12):
        want[t] = x[t].float() * w[t].sum()
    torch.testing.assert_close(comb.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.timeout(180)
def test_v2_op_over_gloo_world2() -> None:
    run_ranks(_suite, 2, backend="gloo", timeout=150)


def test_routing_handle_tensors_round_trip() -> None:
    t = torch.zeros(3, 2, dtype=torch.int32)
    h = EpDispatchRoutingHandle(t, t[:0], t[:0], torch.tensor([5]), torch.arange(5), 3)
    h2 = EpDispatchRoutingHandle.from_tensors(h.tensors(), cur_rank_num_token=3)
    assert h2.cur_rank_num_token == 3 and torch.equal(h2.disp_tok_id_to_src_tok_id_local, torch.arange(5))


# ----------------------------------------------------------------------------- views of fixed buffers
class _FixedBufferEngine:
    """The GPU engines' output contract on CPU: every call writes into the same buffers and returns
    the same view objects (the v2 op builds its views of them once). The data come from the real
    reference engine underneath."""

    def __init__(self, ref: object) -> None:
        self.ref, self.device = ref, torch.device("cpu")
        self.disp: Optional[tuple] = None
        self.comb: Optional[tuple] = None

    def dispatch(self, *args: object, **kwargs: object) -> tuple:
        res = self.ref.dispatch(*args, **kwargs)
        if self.disp is None:
            cap = self.ref.config.max_num_tokens_to_recv()
            self.disp = tuple(None if t is None else torch.zeros((cap,) + tuple(t.shape[1:]), dtype=t.dtype)
                              for t in res[:4]) + (torch.zeros(1, dtype=torch.int32),)
        for buf, t in zip(self.disp, res):
            if t is not None:
                buf[: t.shape[0]].copy_(t)
        return self.disp

    def combine(self, *args: object, **kwargs: object) -> tuple:
        res = self.ref.combine(*args, **kwargs)
        if self.comb is None:
            self.comb = tuple(None if t is None else torch.zeros_like(t) for t in res)
        for buf, t in zip(self.comb, res):
            if t is not None:
                buf.copy_(t)
        return self.comb

    def get_registered_combine_input_buffer(self, dtype: torch.dtype, hidden: int) -> torch.Tensor:
        return self.ref.get_registered_combine_input_buffer(dtype, hidden)

    def get_dispatch_src_token_pos(self) -> torch.Tensor:
        return self.ref.get_dispatch_src_token_pos()


def _fixed_buffer_suite(rank: int, world: int) -> None:
    op = _op(rank, world, max_total_recv_tokens=2 * M)
    op._engine = _FixedBufferEngine(op._engine)
    for n, cap in ((12, None), (7, None), (12, 2 * 12), (9, 2 * 12), (3, None)):
        x, idx, w = _inputs(rank, n)
        x = x * (n + 1)  # a different payload every round
        first = op.dispatch(x, w, None, idx, return_routing=True, recv_cap=cap)
        again = op.dispatch(x, w, None, idx, return_routing=True, recv_cap=cap)
        # the second call reuses the views; their data are this round's
        assert all(a is b for a, b in zip(first[:5], again[:5]) if a is not None)
        out, ow, _, oi, total, h = again
        assert out.shape[0] == (cap or op.cfg.effective_max_recv) and oi.shape[0] == out.shape[0]
        t = int(total[0])
        ref = op._engine.ref.dispatch(x, w, None, idx)
        k = min(t, out.shape[0])
        assert torch.equal(out[:k], ref[0][:k]) and torch.equal(oi[:k], ref[3][:k])
        view = op.combine_in_view()[: out.shape[0]]
        view[:k].copy_(out[:k])
        op.dispatch(x, w, None, idx)  # the engine's latest dispatch must be the one combined
        h = op.dispatch(x, w, None, idx, return_routing=True, recv_cap=cap)[5]
        comb, cw = op.combine(view, None, None, routing=h)
        assert comb.shape[0] == n and cw.shape[0] == n
        want, want_w = _expected_combine(rank, n)
        torch.testing.assert_close(comb.float(), want * (n + 1), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(cw, want_w, rtol=1e-5, atol=1e-5)
    op.close()


@pytest.mark.timeout(120)
def test_v2_views_of_fixed_engine_buffers() -> None:
    """The op's cached views (built once per recv_cap / token count) show every round's data."""
    run_ranks(_fixed_buffer_suite, 2, backend="gloo", timeout=90)
