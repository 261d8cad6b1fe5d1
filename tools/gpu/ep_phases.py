"""Where one rank's dispatch/combine kernel time goes at small batches.

Needs a profiler build (pip install . -Ccmake.define.MORI_ENABLE_PROFILER=ON; tools/gpu/ep15.sh
`prof` makes one under /tmp/prof_site). Runs world size 1 on GPU 0 with the benchmark's shape
(hidden 7168, top-8 of 256, AUTO launch table) and prints, per call, the span of every phase over
all warps: first begin, last end, median duration.

    PYTHONPATH=/tmp/prof_site python3 tools/gpu/ep_phases.py 128 512
"""
import os
import statistics
import sys

os.environ.setdefault("MORI_EP_LAUNCH_CONFIG_MODE", "AUTO")
import torch
import torch.distributed as dist

torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
dist.init_process_group("cpu:gloo,cuda:nccl", init_method="tcp://127.0.0.1:29611", rank=0, world_size=1, device_id=dev)
torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
import mori_core
import mori_core.shmem as shmem
from mori_core.ops import EpDispatchCombineConfig, EpDispatchCombineOp
from mori_core.ops.profiler import parse_trace

print("build", mori_core.build_info()["profiler"])
shmem.shmem_torch_process_group_init("default")
H, E, K = 7168, 256, 8
for n in [int(t) for t in sys.argv[1:]] or [128]:
    cfg = EpDispatchCombineConfig(data_type=torch.bfloat16, rank=0, world_size=1, hidden_dim=H, scale_dim=0, scale_type_size=4,
                                  max_token_type_size=2, max_num_inp_token_per_rank=max(n, 128), num_experts_per_rank=E, num_experts_per_token=K)
    op = EpDispatchCombineOp(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int32).to(dev)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(n, K, generator=g).to(dev)
    for _ in range(20):
        out, ow, _, _, tot = op.dispatch(x, w, None, idx)
        op.combine(out, ow, idx)
    torch.cuda.synchronize()
    op.reset_debug_time_buf()
    for _ in range(5):
        out, ow, _, _, tot = op.dispatch(x, w, None, idx)
        torch.cuda.synchronize()
        op.combine(out, ow, idx)
        torch.cuda.synchronize()
    spans, dropped = parse_trace(op.get_debug_time_buf())
    p = op._cached_dispatch_launch
    print(f"tokens {n}: dispatch launch {p.block_num}x{p.warp_per_block}, combine {op._cached_combine_launch.block_num}x{op._cached_combine_launch.warp_per_block}; spans {len(spans)} dropped {dropped}")
    kinds = {"dispatch": ("dispatch_route", "dispatch_copy", "dispatch_signal"), "combine": ("combine_stage", "combine_barrier", "combine_reduce")}
    for kname, phases in kinds.items():
        rounds = sorted({s.round for s in spans if s.phase in phases})
        for rnd in rounds[-3:]:
            sel = [s for s in spans if s.round == rnd and s.phase in phases]
            t0 = min(s.begin_ns for s in sel)
            t1 = max(s.end_ns for s in sel)
            line = f"  {kname} round {rnd}: first warp start -> last warp end {(t1 - t0) / 1e3:.2f} us;"
            for ph in phases:
                ps = [s for s in sel if s.phase == ph]
                if not ps:
                    continue
                b = [s.begin_ns - t0 for s in ps]
                e = [s.end_ns - t0 for s in ps]
                d = [s.end_ns - s.begin_ns for s in ps]
                line += (f" {ph}: n={len(ps)} begin {min(b)/1e3:.2f}-{max(b)/1e3:.2f} end {min(e)/1e3:.2f}-{max(e)/1e3:.2f}"
                         f" dur med {statistics.median(d)/1e3:.2f} max {max(d)/1e3:.2f};")
            print(line)
    op.close()
shmem.shmem_finalize()
dist.destroy_process_group()
