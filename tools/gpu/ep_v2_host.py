"""Where the EPv2 face's host time goes, on one GPU at EP1 (one process).

    python tools/gpu/ep_v2_host.py

For each combine mode (gather, scatter): the host time of the engine call alone (the v1 op behind
the v2 op, with and without launch overrides) and of the v2 call SGLang makes, with the GPU idle
before each call (median of 200, microseconds), and how many calls fell back to the full argument
validation; then a cProfile of 500 v2 dispatch + combine rounds. Host figures only: not a
latency benchmark (that is ``python -m mori_core.bench ep --v2``)."""
import cProfile, os, pstats, statistics, time
import torch, torch.distributed as dist
os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "4G")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ.get('MORI_PROBE_PORT', '29911')}", rank=0, world_size=1)
torch.cuda.set_device(0)
from mori_core.cco import Communicator
from mori_core.ops.dispatch_combine_v2 import EpDispatchCombineConfig, EpDispatchCombineOp
comm = Communicator.init(1, 0, Communicator.get_unique_id())
ops = {m: EpDispatchCombineOp(EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=7168, max_num_inp_token_per_rank=4096,
       num_experts_per_rank=256, num_experts_per_token=8, data_type=torch.bfloat16, combine_mode=m), comm) for m in ("gather", "scatter")}
n = 128
x = torch.randn(n, 7168, device="cuda").bfloat16(); w = torch.rand(n, 8, device="cuda")
idx = torch.rand(n, 256, device="cuda").topk(8, dim=1).indices.to(torch.int32)
def host(fn, k=200):
    ts = []
    for _ in range(k):
        torch.cuda.synchronize(); t0 = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1000
for m, op in ops.items():
    eng = op._engine
    cnt = {"vd": 0, "vc": 0}
    vd, vc = eng._validate_dispatch, eng._validate_combine
    def wd(*a, **k): cnt["vd"] += 1; return vd(*a, **k)
    def wc(*a, **k): cnt["vc"] += 1; return vc(*a, **k)
    eng._validate_dispatch, eng._validate_combine = wd, wc
    db, dw, cb, cw = op._launch(n)
    cap = op.cfg.effective_max_recv
    r = op.dispatch(x, w, None, idx, return_routing=True, recv_cap=cap, clone_routing=False)
    h = r[-1]
    view = op.combine_in_view()[: r[0].shape[0]]; view.copy_(r[0])
    rows = {
        "engine.dispatch()": lambda: eng.dispatch(x, w, None, idx),
        "engine.dispatch(block_num=..)": lambda: eng.dispatch(x, w, None, idx, block_num=db, warp_per_block=dw),
        "v2 dispatch(routing)": lambda: op.dispatch(x, w, None, idx, return_routing=True, recv_cap=cap, clone_routing=False),
    }
    for k, fn in rows.items():
        cnt["vd"] = 0
        print(f"{m:8s} {k:32s} {host(fn):7.1f} us  validations {cnt['vd']}")
    r = op.dispatch(x, w, None, idx, return_routing=True, recv_cap=cap, clone_routing=False); h = r[-1]
    push = int(op._push)
    rows = {
        "engine.combine()": lambda: eng.combine(view, None, idx, use_external_inp_buf=push),
        "engine.combine(block_num=..)": lambda: eng.combine(view, None, idx, block_num=cb, warp_per_block=cw, use_external_inp_buf=push),
        "engine.combine(weights)": lambda: eng.combine(view, r[1], idx, block_num=cb, warp_per_block=cw, use_external_inp_buf=push),
        "v2 combine": lambda: op.combine(view, None, r[3], routing=h),
    }
    for k, fn in rows.items():
        cnt["vc"] = 0
        print(f"{m:8s} {k:32s} {host(fn):7.1f} us  validations {cnt['vc']}")
    if m == "gather":
        pr = cProfile.Profile(); pr.enable()
        for _ in range(500):
            r = op.dispatch(x, w, None, idx, return_routing=True, recv_cap=cap, clone_routing=False)
            op.combine(view, None, r[3], routing=r[-1])
        torch.cuda.synchronize(); pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
for op in ops.values(): op.close()
comm.destroy()
