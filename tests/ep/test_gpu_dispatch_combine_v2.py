"""GPU tests of MORI's EPv2 API on mori_core (``mori.ops.dispatch_combine_v2`` + ``mori.cco``).

EP2 and EP4 run as separate processes placed by ``MORI_RANKS_PER_GPU`` (default auto: one rank
per GPU where there are enough GPUs, otherwise rank r on cuda device ``r % device_count``, sharing
it; gloo instead of NCCL). Each rank
builds a GPU ``mori.cco.Communicator`` from a unique id (shmem heap + CUDA IPC between the
processes), the v1 op, and v2 ops, and checks against the v1 op and the reference engine (gloo):

* bf16 gather (pull) and scatter (push): v2 combine == v1 combine == reference, bit-exact;
  v2 dispatch rows bit-exact against the source rank's tokens (by source position).
* FP8 dispatch with fp32 scales: rows and scales bit-exact by source position.
* FP8 combine quant (fp8_direct_cast, fp8_blockwise): v2 against the reference with the same
  quant (shared numerics), and against bf16 within the FP8 error.
* ``prepare_recv_cap`` tiers: views of the tier, same combine.
* ``local_expert_count`` against the senders' routing.
* CUDA-graph capture of v2 dispatch + combine, replayed on new inputs.

This is correctness only (timings mean nothing where ranks share a GPU). Run on the GPU machine:
``python -m pytest -q tests/ep/test_gpu_dispatch_combine_v2.py``. The same rank function runs on
CPU (reference engine behind the v2 op, no graphs) in ``test_v2_suite_logic_on_cpu``.
"""

from __future__ import annotations

import os

import pytest
import torch

from ep_dist_utils import free_port, run_ranks

H, K, EPR, M = 1024, 4, 4, 64
FP8 = torch.float8_e4m3fn


def _inputs(seed: int, rank: int, n: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, EPR * world, generator=g).topk(K, dim=1).indices.to(torch.int32)
    idx[torch.rand(n, K, generator=g) < 0.05] = -1
    w = torch.rand(n, K, generator=g)
    return x, idx, w


def _join(rank: int, world: int, port: int, kind: str):
    """Process group (gloo), device, and a v2 communicator of ``kind`` ("cuda" or "cpu")."""
    import torch.distributed as dist

    from mori.cco import Communicator

    if kind == "cuda":
        from mori_core.placement import init_rank_process_group, placement

        os.environ["MORI_SHMEM_HEAP_SIZE"] = placement(world).heap_size("2G")
        dev = init_rank_process_group(rank, world, f"tcp://127.0.0.1:{port}", use_nccl=False)
        assert dev.index == rank % torch.cuda.device_count()
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dev = torch.device("cpu")
    obj = [Communicator.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    comm = Communicator.init(world, rank, obj[0], group=None if kind == "cuda" else dist.group.WORLD)
    assert comm.is_gpu == (kind == "cuda") and comm.create_dev_comm().lsa_size == world
    return dev, comm


_CREATED: list = []  # v2 ops of this rank, closed (collectively, in order) at the end


def _v2(comm, rank: int, world: int, **kw):
    from mori.ops.dispatch_combine_v2 import EpDispatchCombineConfig, EpDispatchCombineOp

    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=EPR, num_experts_per_token=K, **kw)
    op = EpDispatchCombineOp(cfg, comm)
    comm.barrier()
    _CREATED.append(op)
    return op


def _reference(config):
    """The reference engine for a v1 config or a v2 op's engine config (gloo, CPU tensors)."""
    from mori_core.ops import ReferenceEpDispatchCombineOp

    config = config.cfg.engine_config() if hasattr(config, "cfg") else config
    return ReferenceEpDispatchCombineOp(config, device=torch.device("cpu"))


def _ref_round_trip(ref, x, idx, w) -> tuple[torch.Tensor, torch.Tensor]:
    """Identity experts on the reference engine: (combined tokens, combined weights)."""
    out, ow, _, _, total = ref.dispatch(x, w, None, idx)
    t = int(total[0])
    push = bool(ref.config.use_external_inp_buf)
    rows = out if push else ref.get_registered_combine_input_buffer(out.dtype)
    if not push:
        rows[:t].copy_(out[:t])
    c, cw = ref.combine(rows, ow, idx, use_external_inp_buf=int(push))
    return c[: x.shape[0]].clone(), cw[: x.shape[0]].clone()


def _v2_round_trip(op, x, idx, w, recv_cap=None):
    kwargs = {"return_routing": True}
    if recv_cap is not None:
        kwargs.update(recv_cap=recv_cap, clone_routing=False)
    out, ow, _, oi, total, h = op.dispatch(x, w, None, idx, **kwargs)
    view = op.combine_in_view()[: out.shape[0]]
    view.copy_(out)  # identity experts, written where combine reads them without a copy
    c, cw = op.combine(view, None, oi, routing=h)
    return out, total, h, c, cw


def _check_rows(out, h, seed, world, n, dev) -> None:
    """Every received row is bit-exactly its source rank's token (by source position)."""
    pos = h.disp_tok_id_to_src_tok_id_local.cpu().tolist()
    for row, flat in enumerate(pos):
        src, tok = divmod(int(flat), world * M)
        want = _inputs(seed, src, n, world)[0][tok]
        assert torch.equal(out[row].cpu(), want), (row, src, tok)


def _suite(rank: int, world: int, port: int, kind: str) -> None:
    from mori_core.ops import EpDispatchCombineConfig as V1Config
    from mori_core.ops import EpDispatchCombineOp as V1Op
    from mori_core.ops import ReferenceEpDispatchCombineOp

    dev, comm = _join(rank, world, port, kind)
    n = 48
    x, idx, w = _inputs(1, rank, n, world)
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)

    # --- bf16, gather and scatter: v2 == v1 == reference (bit-exact), rows by source position
    v1_cfg = V1Config(data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=H, scale_dim=0,
                      scale_type_size=0, max_token_type_size=2, max_num_inp_token_per_rank=M,
                      num_experts_per_rank=EPR, num_experts_per_token=K, use_external_inp_buf=False)
    v1 = V1Op(v1_cfg) if kind == "cuda" else ReferenceEpDispatchCombineOp(v1_cfg, device=dev)
    want, want_w = _ref_round_trip(_reference(v1_cfg), x, idx, w)
    v1_out, v1_w = _ref_round_trip(v1, xd, idxd, wd)
    assert torch.equal(v1_out.cpu(), want) and torch.equal(v1_w.cpu(), want_w)
    ops = {}
    for mode in ("gather", "scatter"):
        op = ops[mode] = _v2(comm, rank, world, combine_mode=mode)
        assert op.backend_name == ("mori_core" if kind == "cuda" else "mori_core.reference")
        out, total, h, c, cw = _v2_round_trip(op, xd, idxd, wd)
        _check_rows(out, h, 1, world, n, dev)
        assert torch.equal(c.cpu(), want), (mode, (c.cpu().float() - want.float()).abs().max())
        assert torch.equal(cw.cpu(), want_w), mode
        # local_expert_count against every sender's routing
        lec = op.local_expert_count().cpu()
        expect = torch.zeros(EPR, dtype=torch.int32)
        for src in range(world):
            for e in _inputs(1, src, n, world)[1].flatten().tolist():
                if rank * EPR <= e < (rank + 1) * EPR:
                    expect[e - rank * EPR] += 1
        assert torch.equal(lec, expect), (lec, expect)

    # --- prepare_recv_cap tiers: views of the tier, same result (the tier covers the rows)
    op = ops["gather"]
    cap = 32
    while cap <= op.cfg.effective_max_recv:
        op.prepare_recv_cap(cap)
        cap *= 2
    small = 6  # 6 tokens x world ranks <= 32 rows: the smallest tier covers them
    xs, idxs, ws = _inputs(2, rank, small, world)
    want_s, _ = _ref_round_trip(_reference(op), xs, idxs, ws)
    for tier in (32, op.cfg.effective_max_recv):
        out, total, h, c, _ = _v2_round_trip(op, xs.to(dev), idxs.to(dev), ws.to(dev), recv_cap=tier)
        assert out.shape[0] == tier and int(total[0]) <= tier
        assert torch.equal(c.cpu(), want_s), tier

    # --- FP8 dispatch with fp32 per-128 scales: rows and scales bit-exact by source position
    f8 = _v2(comm, rank, world, dispatch_data_type=FP8, combine_data_type=torch.bfloat16, scale_dim=H // 128,
             scale_type_size=4)

    def fp8_inputs(src: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(50 + src)
        return (torch.randn(n, H, generator=g) * 8).to(FP8), torch.rand(n, H // 128, generator=g)

    q, s = fp8_inputs(rank)
    out, _, osc, _, total, h = f8.dispatch(q.to(dev), wd, s.to(dev), idxd, return_routing=True)
    assert osc.dtype == torch.int32 and osc.shape[1] == H // 128
    for row, flat in enumerate(h.disp_tok_id_to_src_tok_id_local.cpu().tolist()):
        src, tok = divmod(int(flat), world * M)
        qs, ss = fp8_inputs(src)
        assert torch.equal(out[row].cpu().view(torch.uint8), qs[tok].view(torch.uint8))
        assert torch.equal(osc[row].cpu().view(torch.float32), ss[tok])
    f8.combine(torch.zeros(f8.cfg.effective_max_recv, H, dtype=torch.bfloat16, device=dev), routing=h)

    # --- FP8 combine quant (scatter): equals the reference with the same quant; near bf16
    for quant in ("fp8_direct_cast", "fp8_blockwise"):
        opq = _v2(comm, rank, world, quant_type=quant)
        ref_q, _ = _ref_round_trip(_reference(opq), x, idx, w)
        _, _, _, c, _ = _v2_round_trip(opq, xd, idxd, wd)
        torch.testing.assert_close(c.cpu().float(), ref_q.float(), rtol=0, atol=1e-2 * float(ref_q.abs().max()))
        rel = (c.cpu().float() - want.float()).norm() / want.float().norm()
        assert 0 < rel < 0.08, (quant, float(rel))

    # --- CUDA graph: capture v2 dispatch + combine, replay on new inputs
    if kind == "cuda":
        op = ops["gather"]
        sx, sidx, sw = xd.clone(), idxd.clone(), wd.clone()
        _v2_round_trip(op, sx, sidx, sw)  # warm-up outside the graph
        torch.cuda.synchronize()
        comm.barrier()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            _, _, _, gc, gcw = _v2_round_trip(op, sx, sidx, sw)
        torch.cuda.synchronize()
        comm.barrier()
        for seed in (3, 4):
            x2, idx2, w2 = _inputs(seed, rank, n, world)
            sx.copy_(x2.to(dev))
            sidx.copy_(idx2.to(dev))
            sw.copy_(w2.to(dev))
            torch.cuda.synchronize()
            comm.barrier()
            graph.replay()
            torch.cuda.synchronize()
            want2, want2_w = _ref_round_trip(_reference(op), x2, idx2, w2)
            assert torch.equal(gc.cpu(), want2), seed
            assert torch.equal(gcw.cpu(), want2_w), seed
            comm.barrier()
        del graph

    comm.barrier()
    for o in _CREATED:
        o.close()
    if kind == "cuda":
        v1.close()
    comm.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_v2_suite(world: int) -> None:
    env = {"MORI_EP_TIMEOUT_MS": "120000"}
    run_ranks(_suite, world, backend=None, timeout=600, env=env, port=free_port(), kind="cuda")


@pytest.mark.timeout(180)
def test_v2_suite_logic_on_cpu() -> None:
    """The GPU suite's checks with the reference engine behind the v2 op (CPU, gloo, EP2)."""
    run_ranks(_suite, 2, backend=None, timeout=150, port=free_port(), kind="cpu")
