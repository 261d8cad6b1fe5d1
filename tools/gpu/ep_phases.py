"""Where each rank's dispatch/combine kernel time goes at small batches, one rank per GPU.

Needs a profiler build (pip install . -Ccmake.define.MORI_ENABLE_PROFILER=ON; tools/gpu/ep15.sh
`prof` and tools/gpu/link_profile.sh `profbuild` make one under /tmp/prof_site). Runs WORLD ranks (default 1)
with the benchmark's shape (hidden 7168, top-8 of 256 experts, AUTO launch table), dispatch in
DTYPE (bf16, or fp8 with 56 fp32 scales per token as `bench ep`) and, for bf16, the default
combine of its rows, and prints per rank, for the last calls: every phase's span over all warps (first begin,
last end, relative to the rank's first warp) and the median warp's duration. Each call is
synchronised on the host before the next (so no call waits for a previous one); with --graph the
calls run back to back in one CUDA graph replay instead, as the bench's graph figures run them
(the rounds' "start" fields then give the period between calls).

    PYTHONPATH=/tmp/prof_site python3 tools/gpu/ep_phases.py [--world 4] [--dtype fp8] [--std] [--blocks] [--graph] 128 512
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

H, E, K, SCALES = 7168, 256, 8, 56
PHASES = {"dispatch": ("std_plan", "dispatch_route", "std_bits", "std_rank", "std_count", "dispatch_copy",
                        "dispatch_signal", "std_expand", "std_expand_base", "std_expand_first", "std_expand_items"),
          "combine": ("combine_stage", "combine_barrier", "combine_reduce")}


def _quantiles(xs: list[float]) -> str:
    """min / p25 / median / p75 / max of xs, "a/b/c/d/e"."""
    q = sorted(xs)
    pick = [q[0], q[len(q) // 4], q[len(q) // 2], q[(3 * len(q)) // 4], q[-1]]
    return "/".join(f"{v:.2f}" for v in pick)


def _block_lines(sel: list, t0: int) -> list[str]:
    """Per-block view of one dispatch round: each block's first warp begin, its route duration
    (warp 0: masks, the slot reservation round trip, slots) and its last copy end, as quantiles
    over blocks (us). Tells a serialised reservation (route durations spread) from late blocks
    (begins spread)."""
    by_block: dict[int, dict[str, list]] = {}
    for s in sel:
        by_block.setdefault(s.block, {}).setdefault(s.phase, []).append(s)
    begins, routes, copy_ends = [], [], []
    for phases in by_block.values():
        every = [s for ps in phases.values() for s in ps]
        begins.append((min(s.begin_ns for s in every) - t0) / 1e3)
        r0 = [s for s in phases.get("dispatch_route", []) if s.warp == 0]
        if r0:
            routes.append(sum(s.end_ns - s.begin_ns for s in r0) / 1e3)
        if phases.get("dispatch_copy"):
            copy_ends.append((max(s.end_ns for s in phases["dispatch_copy"]) - t0) / 1e3)
    out = [f"    blocks {len(by_block)}: first begin {_quantiles(begins)}"]
    if routes:
        out.append(f"    route (warp 0, per block) {_quantiles(routes)}")
    if copy_ends:
        out.append(f"    copy end (per block) {_quantiles(copy_ends)}")
    return out


def _rank(rank: int, world: int, port: int, dtype: str, tokens: list[int], calls: int, std: bool,
          blocks: bool, graph: bool) -> None:
    os.environ.setdefault("MORI_EP_LAUNCH_CONFIG_MODE", "AUTO")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
    import mori_core
    import mori_core.shmem as shmem
    from mori_core.ops import EpDispatchCombineConfig, EpDispatchCombineOp
    from mori_core.ops.profiler import parse_trace

    if rank == 0:
        print("profiler build:", mori_core.build_info()["profiler"], "| world", world, "| dispatch", dtype, flush=True)
    shmem.shmem_torch_process_group_init("default")
    fp8 = dtype == "fp8"
    for n in tokens:
        cfg = EpDispatchCombineConfig(data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=H,
                                      scale_dim=SCALES if fp8 else 0, scale_type_size=4, max_token_type_size=2,
                                      max_num_inp_token_per_rank=max(n, 128), num_experts_per_rank=E // world,
                                      num_experts_per_token=K)
        op = EpDispatchCombineOp(cfg)
        g = torch.Generator().manual_seed(1 + rank)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int32).to(dev)
        x = torch.randn(n, H, generator=g).to(torch.bfloat16).to(dev)
        w = torch.rand(n, K, generator=g).to(dev)
        xd = x.clamp(-6, 6).to(torch.float8_e4m3fn) if fp8 else x
        sc = torch.rand(n, SCALES, device=dev) if fp8 else None

        def one(sync: bool) -> None:
            """One dispatch (fp8 or --std: dispatch only) and, for bf16, the default combine of its rows."""
            if std:
                op.dispatch_standard_moe(xd, w, sc, idx)
                if sync:
                    torch.cuda.synchronize()
                    dist.barrier()
                return
            out, ow, _, _, _ = op.dispatch(xd, w, sc, idx)
            if sync:
                torch.cuda.synchronize()
                dist.barrier()
            if not fp8:
                op.combine(out, ow, idx)
                if sync:
                    torch.cuda.synchronize()
                    dist.barrier()

        for _ in range(10):
            one(False)
        torch.cuda.synchronize()
        dist.barrier()
        if graph:  # back-to-back calls as the bench's graph replays make them, no host step between
            g_calls = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_calls):
                for _ in range(calls):
                    one(False)
            g_calls.replay()
            torch.cuda.synchronize()
            dist.barrier()
            op.reset_debug_time_buf()
            g_calls.replay()
            torch.cuda.synchronize()
            dist.barrier()
        else:
            op.reset_debug_time_buf()
            for _ in range(calls):
                one(True)
        spans, dropped = parse_trace(op.get_debug_time_buf())
        lines = []
        grid = {k: (f"{p.block_num}x{p.warp_per_block}" if p is not None else "-")
                for k, p in (("dispatch", op._cached_dispatch_launch), ("combine", op._cached_combine_launch))}
        lines.append(f"rank {rank}, {n} tokens: dispatch {grid['dispatch']}, combine {grid['combine']}; "
                     f"spans {len(spans)}, dropped {dropped}")
        for kname, phases in PHASES.items():
            rounds = sorted({s.round for s in spans if s.phase in phases})
            for rnd in rounds[-2:]:
                sel = [s for s in spans if s.round == rnd and s.phase in phases]
                t0 = min(s.begin_ns for s in sel)
                t1 = max(s.end_ns for s in sel)
                line = f"  {kname} round {rnd}: {(t1 - t0) / 1e3:.2f} us (start {t0 % 10**9 / 1e3:.1f} us mod 1 s);"
                for ph in phases:
                    ps = [s for s in sel if s.phase == ph]
                    if ps:
                        b = [(s.begin_ns - t0) / 1e3 for s in ps]
                        e = [(s.end_ns - t0) / 1e3 for s in ps]
                        dur = [(s.end_ns - s.begin_ns) / 1e3 for s in ps]
                        line += (f" {ph} n={len(ps)} begin {min(b):.2f}-{max(b):.2f} end {min(e):.2f}-{max(e):.2f}"
                                 f" med {statistics.median(dur):.2f};")
                lines.append(line)
                if blocks and kname == "dispatch":
                    lines.extend(_block_lines(sel, t0))
        report = [None] * world
        dist.all_gather_object(report, lines)
        if rank == 0:
            for r in report:
                print("\n".join(r), flush=True)
        op.close()
    shmem.shmem_finalize()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokens", nargs="*", type=int, default=[128])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--std", action="store_true", help="dispatch_standard_moe instead of dispatch (no combine)")
    ap.add_argument("--blocks", action="store_true", help="per-block quantiles of the dispatch's phases")
    ap.add_argument("--graph", action="store_true",
                    help="the calls back to back in one CUDA graph replay (no host sync between them)")
    ap.add_argument("--std-path", type=int, choices=(0, 1, 2), default=None,
                    help="MORI_EP_STD_FUSED for the op (0: three launches, 1: two, 2: one)")
    a = ap.parse_args()
    if a.std_path is not None:  # read when the op is built, in every spawned rank
        os.environ["MORI_EP_STD_FUSED"] = str(a.std_path)
    if a.world > torch.cuda.device_count():
        raise SystemExit(f"--world {a.world}: only {torch.cuda.device_count()} GPUs visible (one rank per GPU)")
    mp.spawn(_rank, args=(a.world, a.port, a.dtype, a.tokens, a.calls, a.std, a.blocks, a.graph), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
