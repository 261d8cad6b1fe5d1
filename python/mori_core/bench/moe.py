"""``python -m mori_core.bench moe``: one MoE layer over MORI-EP (seed 002's benchmark_mori_ep_moe).

Each EP rank (one process per rank, placed by ``mori_core.placement``) runs what vLLM's ``mori_ep`` backend runs per MoE layer:
dispatch its tokens to the ranks owning their top-k experts, read the received-token count,
run a grouped gated-SiLU expert FFN in torch over the received rows (local experts only,
gating weights applied), and combine the rows back. Every phase is timed with CUDA events;
the table reports medians over iterations of the slowest rank, and the share of the layer
spent in dispatch + combine. Beside it, a single-GPU baseline measured in the same run: one
GPU with all experts resident runs the same tokens per GPU through the same FFN (no
communication). Each EP run is also checked against an expert-by-expert reference.

``--device cpu`` runs the same code with the reference EP operator over gloo (smoke test;
its times say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

from mori_core.bench.spawned import first_result
from mori_core.bench.table import median, print_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the MoE benchmark."""
    p.add_argument("--world-sizes", default="2,4", help="EP sizes to run, comma-separated (default 2,4)")
    p.add_argument("--tokens", default="128,512,4096", help="tokens per rank, comma-separated (default 128,512,4096)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--intermediate", type=int, default=2048, help="expert intermediate size (default 2048)")
    p.add_argument("--num-experts", type=int, default=256, help="global number of experts (default 256)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--fp8-dispatch", action="store_true", help="FP8 (e4m3, per-token scales) token transport")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: reference operator over gloo")
    p.add_argument("--no-baseline", action="store_true", help="skip the single-GPU baseline")
    p.add_argument(
        "--ffn",
        choices=("auto", "loop"),
        default="auto",
        help="expert FFN: auto = torch._grouped_mm when it checks out on this GPU, else a per-expert loop",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one world size may take (default 900)")


@dataclass(frozen=True)
class Shape:
    """The MoE layer being measured."""

    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    dtype_name: str
    device_type: str
    fp8_dispatch: bool
    ffn: str = "auto"
    seed: int = 2024

    @property
    def dtype(self) -> Any:
        import torch

        return torch.bfloat16 if self.dtype_name == "bf16" else torch.float32


# ------------------------------------------------------------------------------ layer math
def expert_weights(shape: Shape, expert: int, device: Any) -> tuple[Any, Any]:
    """Expert ``expert``'s (w13 [2I, H], w2 [H, I]), regenerated identically on any rank."""
    import torch

    g = torch.Generator(device=device).manual_seed(shape.seed * 1_000_003 + expert)
    h, i = shape.hidden, shape.intermediate
    w13 = torch.randn(2 * i, h, generator=g, device=device, dtype=torch.float32) / h**0.5
    w2 = torch.randn(h, i, generator=g, device=device, dtype=torch.float32) / i**0.5
    return w13.to(shape.dtype), w2.to(shape.dtype)


def make_tokens(shape: Shape, rank: int, n: int, device: Any) -> tuple[Any, Any, Any]:
    """Tokens of ``rank``: x [n, H], uniform random top-k ids [n, k] int32, weights [n, k] f32."""
    import torch

    g = torch.Generator(device=device).manual_seed(shape.seed + 7919 * (rank + 1) + n)
    x = torch.randn(n, shape.hidden, generator=g, device=device, dtype=torch.float32).to(shape.dtype)
    scores = torch.rand(n, shape.num_experts, generator=g, device=device)
    ids = scores.topk(shape.topk, dim=1).indices.to(torch.int32)
    weights = torch.rand(n, shape.topk, generator=g, device=device, dtype=torch.float32) + 0.25
    return x, ids, weights


class GroupedFFN:
    """Gated-SiLU FFN of a contiguous range of experts over received tokens.

    Rows are grouped by expert (sort), run through ``torch._grouped_mm`` where it works on
    this GPU (checked against the per-expert loop at start-up), else a loop of two GEMMs per
    expert; gating weights are applied and the top-k sum is accumulated in float32.
    """

    def __init__(self, w13: Any, w2: Any, first_expert: int, allow_grouped_mm: bool = True) -> None:
        self.w13, self.w2 = w13, w2  # [E_local, 2I, H], [E_local, H, I]
        self.first = int(first_expert)
        self.num = int(w13.shape[0])
        self.inter = int(w2.shape[2])
        self.kind = "loop"
        self._w13_t = self._w2_t = None
        if allow_grouped_mm and w13.is_cuda and hasattr(__import__("torch"), "_grouped_mm"):
            self._try_grouped_mm()

    def _try_grouped_mm(self) -> None:
        import torch

        self._w13_t, self._w2_t = self.w13.transpose(1, 2), self.w2.transpose(1, 2)  # [E, H, 2I], [E, I, H]
        try:
            g = torch.Generator(device=self.w13.device).manual_seed(1)
            n = 64
            x = torch.randn(n, self.w13.shape[2], generator=g, device=self.w13.device).to(self.w13.dtype)
            ids = torch.randint(0, self.num, (n, 1), generator=g, device=self.w13.device, dtype=torch.int32)
            ids += self.first
            w = torch.ones(n, 1, device=self.w13.device)
            self.kind = "grouped_mm"
            fast = self(x, ids, w)
            self.kind = "loop"
            ref = self(x, ids, w)
            if torch.allclose(fast.float(), ref.float(), atol=5e-2, rtol=5e-2):
                self.kind = "grouped_mm"
        except Exception:
            self.kind = "loop"

    def __call__(self, x: Any, ids: Any, weights: Any) -> Any:
        """``out[r] = sum_k [ids[r,k] local] w[r,k] * FFN_{ids[r,k]}(x[r])`` -> [R, H] in x.dtype."""
        import torch
        import torch.nn.functional as F

        r, k = ids.shape
        local = ids.to(torch.int64) - self.first
        valid = (local >= 0) & (local < self.num)
        flat = torch.nonzero(valid.flatten(), as_tuple=True)[0]
        experts = local.flatten()[flat]
        order = torch.argsort(experts, stable=True)
        flat, experts = flat[order], experts[order]
        rows = flat // k
        xs = x[rows]
        counts = torch.bincount(experts, minlength=self.num)
        y = None
        if self.kind == "grouped_mm" and xs.shape[0] > 0:
            try:
                offs = torch.cumsum(counts, 0).to(torch.int32)
                h = torch._grouped_mm(xs, self._w13_t, offs=offs)
                act = F.silu(h[:, : self.inter]) * h[:, self.inter :]
                y = torch._grouped_mm(act.contiguous(), self._w2_t, offs=offs)
            except RuntimeError:  # e.g. a group layout this torch build refuses: use the loop
                self.kind = "loop"
        if y is None:
            y = torch.empty(xs.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
            start = 0
            for e, c in enumerate(counts.tolist()):
                if c:
                    h = xs[start : start + c] @ self.w13[e].t()
                    act = F.silu(h[:, : self.inter]) * h[:, self.inter :]
                    y[start : start + c] = act @ self.w2[e].t()
                    start += c
        out = torch.zeros(r, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, rows, y.to(torch.float32) * weights.flatten()[flat].unsqueeze(1))
        return out.to(x.dtype)


def reference_output(shape: Shape, x: Any, ids: Any, weights: Any) -> Any:
    """Expert-by-expert MoE of the given tokens (float32), regenerating each used expert."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape[0], shape.hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        w13, w2 = expert_weights(shape, e, x.device)
        h = x[rows].float() @ w13.float().t()
        y = (F.silu(h[:, : shape.intermediate]) * h[:, shape.intermediate :]) @ w2.float().t()
        out.index_add_(0, rows, y * weights[rows, slots].unsqueeze(1))
    return out


# ------------------------------------------------------------------------------ timing
class _Timer:
    """Phase timer: CUDA events on GPUs, perf_counter (after the work) on CPU."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def phases_us(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) * 1e3 for a, b in zip(self.marks[:-1], self.marks[1:], strict=True)]
        return [(b - a) * 1e6 for a, b in zip(self.marks[:-1], self.marks[1:], strict=True)]


def _fp8_quantize(x: Any) -> tuple[Any, Any]:
    import torch

    amax = x.float().abs().amax(dim=1, keepdim=True)
    s = (amax / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-10)
    return (x.float() / s).to(torch.float8_e4m3fn), s.contiguous()


class _LayerStep:
    """One MoE layer on one rank: dispatch (+ host read of the count), experts, combine."""

    def __init__(self, op: Any, ffn: GroupedFFN, shape: Shape, x: Any, ids: Any, weights: Any) -> None:
        self.op, self.ffn, self.shape = op, ffn, shape
        self.x, self.ids, self.weights = x, ids, weights

    def __call__(self, timer: Optional[_Timer]) -> tuple[Any, int]:
        mark = timer.mark if timer else (lambda: None)
        op, n = self.op, self.x.shape[0]
        mark()
        if self.shape.fp8_dispatch:
            xq, s = _fp8_quantize(self.x)
            out, ow, out_s, oi, total = op.dispatch(xq, self.weights, s, self.ids)
            r = int(total[0].item())
            recv = (out[:r].float() * out_s[:r]).to(self.shape.dtype)
        else:
            out, ow, _, oi, total = op.dispatch(self.x, self.weights, None, self.ids)
            r = int(total[0].item())
            recv = out[:r]
        mark()
        y = self.ffn(recv, oi[:r], ow[:r])
        mark()
        combined = op.combine(y, None, self.ids)[0][:n]
        mark()
        return combined, r


def _ep_rank(
    rank: int, world: int, port: int, shape: Shape, tokens: list[int], iters: int, warmup: int, q: Any
) -> None:
    """One EP rank: time every token count, check correctness, send results to rank 0's queue."""
    import torch
    import torch.distributed as dist

    try:
        init = f"tcp://127.0.0.1:{port}"
        if shape.device_type == "cuda":  # placed by mori_core.placement (several ranks per GPU when short of GPUs)
            from mori_core.placement import init_rank_process_group

            device = init_rank_process_group(rank, world, init, use_nccl=False)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        from mori_core.ops import EpDispatchCombineConfig

        per = shape.num_experts // world
        cfg = EpDispatchCombineConfig(
            data_type=shape.dtype,
            rank=rank,
            world_size=world,
            hidden_dim=shape.hidden,
            scale_dim=1 if shape.fp8_dispatch else 0,
            scale_type_size=4 if shape.fp8_dispatch else 0,
            max_token_type_size=torch.empty(0, dtype=shape.dtype).element_size(),
            max_num_inp_token_per_rank=max(tokens),
            num_experts_per_rank=per,
            num_experts_per_token=shape.topk,
        )
        shmem = None
        if device.type == "cuda":
            import mori_core.shmem as shmem
            from mori_core.ops import EpDispatchCombineOp

            torch._C._distributed_c10d._register_process_group("bench_moe", dist.group.WORLD)
            shmem.shmem_torch_process_group_init("bench_moe")
            sm = torch.cuda.get_device_properties(device).multi_processor_count
            cfg.block_num, cfg.warp_num_per_block = sm, 16
            op = EpDispatchCombineOp(cfg)
        else:
            from mori_core.ops import ReferenceEpDispatchCombineOp

            op = ReferenceEpDispatchCombineOp(cfg, device=device)
        ws = [expert_weights(shape, e, device) for e in range(rank * per, (rank + 1) * per)]
        ffn = GroupedFFN(
            torch.stack([w[0] for w in ws]), torch.stack([w[1] for w in ws]), rank * per, shape.ffn == "auto"
        )
        del ws
        results = []
        for n in tokens:
            x, ids, w = make_tokens(shape, rank, n, device)
            step = _LayerStep(op, ffn, shape, x, ids, w)
            for _ in range(warmup):
                step(None)
            samples = []
            recv_counts = []
            for _ in range(iters):
                dist.barrier()
                t = _Timer(device)
                _, r = step(t)
                samples.append(t.phases_us())
                recv_counts.append(r)
            got, _ = step(None)
            ref = reference_output(shape, x, ids, w)
            tol = 3e-2 if shape.dtype == torch.bfloat16 else 1e-4
            if shape.fp8_dispatch:
                tol = 1.5e-1
            err = float((got.float() - ref).abs().max() / (ref.abs().max() + 1e-6)) if n else 0.0
            results.append({"tokens": n, "samples": samples, "recv": median(recv_counts), "rel_err": err, "tol": tol})
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "ffn": ffn.kind, "results": results})
        if rank == 0:
            q.put(("ok", gathered))
        if hasattr(op, "close"):
            op.close()  # collective on GPU operators
        if shmem is not None:
            torch.cuda.synchronize()
            shmem.shmem_finalize()
        dist.destroy_process_group()
    except BaseException:
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _baseline(shape: Shape, tokens: list[int], iters: int, warmup: int, q: Any) -> None:
    """Single GPU, all experts resident, same tokens per GPU, same FFN: no communication."""
    import torch

    try:
        device = torch.device("cuda", 0) if shape.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ws = [expert_weights(shape, e, device) for e in range(shape.num_experts)]
        ffn = GroupedFFN(torch.stack([w[0] for w in ws]), torch.stack([w[1] for w in ws]), 0, shape.ffn == "auto")
        del ws
        out = {}
        for n in tokens:
            x, ids, w = make_tokens(shape, 0, n, device)
            for _ in range(warmup):
                ffn(x, ids, w)
            samples = []
            for _ in range(iters):
                t = _Timer(device)
                t.mark()
                ffn(x, ids, w)
                t.mark()
                samples.append(t.phases_us()[0])
            out[n] = median(samples)
        q.put(("ok", {"ffn": ffn.kind, "times": out}))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(gathered: list[dict]) -> list[dict]:
    """Per token count: in every iteration take the slowest rank's phases; report medians."""
    rows = []
    for i, first in enumerate(gathered[0]["results"]):
        per_iter = []
        for it in range(len(first["samples"])):
            phases = [g["results"][i]["samples"][it] for g in gathered]
            slowest = max(phases, key=sum)
            total = sum(slowest)
            share = (slowest[0] + slowest[2]) / total if total else 0.0
            per_iter.append(list(slowest) + [total, share])
        d, f, c, total, share = (median([row[j] for row in per_iter]) for j in range(5))
        rows.append(
            {
                "tokens": first["tokens"],
                "dispatch": d,
                "ffn": f,
                "combine": c,
                "layer": total,
                "share": share,
                "recv": int(max(g["results"][i]["recv"] for g in gathered)),
                "rel_err": max(g["results"][i]["rel_err"] for g in gathered),
                "ok": all(g["results"][i]["rel_err"] <= g["results"][i]["tol"] for g in gathered),
            }
        )
    return rows


def _hardware(device_type: str) -> str:
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"CPU (reference operator over gloo), torch {torch.__version__}"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print one table per EP size; returns 1 if a check failed."""
    import torch

    world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    if args.device == "cuda":
        have = torch.cuda.device_count()
        if have < 1:
            raise SystemExit("no CUDA GPU visible; use --device cpu for a smoke run")
        from mori_core.placement import placement

        for w in world_sizes:  # raises when MORI_RANKS_PER_GPU=N needs more GPUs than are visible
            placement(w)
    for w in world_sizes:
        if args.num_experts % w:
            raise SystemExit(f"--num-experts {args.num_experts} must divide evenly over EP size {w}")
    if args.topk > args.num_experts:
        raise SystemExit(f"--topk {args.topk} exceeds --num-experts {args.num_experts}")
    shape = Shape(
        hidden=args.hidden, intermediate=args.intermediate, num_experts=args.num_experts, topk=args.topk,
        dtype_name=args.dtype, device_type=args.device, fp8_dispatch=args.fp8_dispatch, ffn=args.ffn,
    )
    print(
        f"MoE layer: hidden {shape.hidden}, intermediate {shape.intermediate}, {shape.num_experts} experts, "
        f"top-{shape.topk}, {shape.dtype_name}{', FP8 dispatch' if shape.fp8_dispatch else ''}; "
        f"{args.iters} iterations (+{args.warmup} warm-up); hardware: {_hardware(args.device)}",
        flush=True,
    )
    baseline: dict = {}
    if not args.no_baseline:
        res = first_result([(_baseline, (shape, tokens, args.iters, args.warmup))], args.timeout)
        baseline = res["times"]
        print(f"single-GPU baseline FFN: {res['ffn']}", flush=True)
    failed = False
    heap_request = os.environ.get("MORI_SHMEM_HEAP_SIZE")
    for world in world_sizes:
        where = None
        if args.device == "cuda":
            from mori_core.bench.ep.measure import place_ranks

            where = place_ranks(world, heap_request)
        port = _free_port()
        targets = [(_ep_rank, (r, world, port, shape, tokens, args.iters, args.warmup)) for r in range(world)]
        gathered = first_result(targets, args.timeout)
        rows = summarize(gathered)
        table = []
        for r in rows:
            failed |= not r["ok"]
            table.append(
                [
                    r["tokens"],
                    r["recv"],
                    r["dispatch"],
                    r["ffn"],
                    r["combine"],
                    r["layer"],
                    f"{100.0 * r['share']:.1f}%",
                    baseline.get(r["tokens"], "-"),
                    f"{'ok' if r['ok'] else 'FAIL'} ({r['rel_err']:.1e})",
                ]
            )
        if where is not None and where.shared:  # latencies mean nothing when ranks share a GPU
            from mori_core.bench.ep.measure import timing_columns_note

            print_table(
                f"EP{world}: one MoE layer, correctness only; {where.describe()}",
                ["tokens/rank", "recv rows (max)", "check (rel err)"],
                [[t[0], t[1], t[-1]] for t in table],
                note=timing_columns_note(where),
            )
            continue
        print_table(
            f"EP{world}: one MoE layer (us, median over iterations of the slowest rank); FFN: {gathered[0]['ffn']}",
            [
                "tokens/rank",
                "recv rows (max)",
                "dispatch",
                "experts",
                "combine",
                "layer",
                "comm share",
                "1-GPU layer",
                "check (rel err)",
            ],
            table,
            note="comm share = (dispatch + combine) / layer of the slowest rank; dispatch includes reading the "
            "received count on the host (as the vLLM adapter does); 1-GPU layer = the same tokens per GPU through "
            "the same FFN with all experts on one GPU (no communication).",
        )
    return 1 if failed else 0
