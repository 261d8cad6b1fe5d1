"""DeepEP's normal-mode (intranode) kernels as a same-run baseline: ``python -m mori_core.bench ep --deepep``.

DeepEP is never a dependency of mori-suite: this module imports ``deep_ep`` only when asked, and
``--deepep`` prints why it is skipped when the package is not importable (build it with
``tools/gpu/deepep_build.sh``, then put it on ``PYTHONPATH``).

In the benchmark's own rank processes, on the same routing and tokens as our op, per token count:

* DeepEP at every SM count of ``--deepep-sms`` (24, 48, ... up to all SMs) and every NVL chunk
  size of ``--deepep-dispatch-chunks`` / ``--deepep-combine-chunks`` (its ``Config``; receive
  buffer ``--deepep-buffer-tokens``), each timed quickly; the best chunk per SM count is then timed
  in full, and the best SM count is "DeepEP at its best". Dispatch is DeepEP's cached dispatch
  (the handle of a first dispatch at the same SM count: no layout kernel and no CPU sync, the mode
  DeepEP's own tuning times); combine is its combine with that handle and the received weights.
  Also timed once at the best setting: the full dispatch with top-k ids and weights
  (``num_worst_tokens``: no CPU sync; the layout kernel excluded), which moves what ours moves.
* Ours: the dispatches (FP8 with scales, BF16) and the combine as the default call makes it
  (``use_external_inp_buf`` from the config: push) plus push and pull explicitly, at the launch the
  op picks and, SM for SM, with ``block_num`` = each SM count.
* Every time is DeepEP's ``bench()`` method for both libraries: the L2 flushed once (256 MB
  written), warm-up calls, then back-to-back calls with a CUDA event pair around each; the mean
  (DeepEP's figure) and median of all but the first call, and the host time per call (median).
* Checks on the same data: the dispatched rows (and FP8 scales) of both libraries are equal byte
  for byte when ordered by (source rank, source token); the combined rows are equal bit for bit
  (both sum fp32 in ascending rank order and round once), with the same expert applied on both
  sides (rows x (rank + 1)). DeepEP zeroes the received weights of other ranks' experts, ours
  carries every weight, so the combined weights are not compared.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from mori_core.bench.ep.measure import bench_like_deepep, kernel_breakdown, progress

DEFAULT_SMS = "24,48,96,132"
DEFAULT_DISPATCH_CHUNKS = "4,6,8,12,16,24,32"
DEFAULT_COMBINE_CHUNKS = "1,2,4,6,9,10,12,16"
QUICK = (5, 12)
_BARRIER_SIGNALS = 8  # DeepEP's NUM_MAX_NVL_PEERS ints after the NVLink buffer (csrc/deep_ep.cpp)  # (warm-up, timed) calls of a sweep point; the best are re-timed in full


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the DeepEP baseline."""
    p.add_argument("--deepep", action="store_true",
                   help="also run DeepEP's intranode kernels on the same data (skipped when deep_ep is not importable)")
    p.add_argument("--deepep-sms", default=DEFAULT_SMS, help="DeepEP SM counts to try (even; capped at the GPU's SMs)")
    p.add_argument("--deepep-dispatch-chunks", default=DEFAULT_DISPATCH_CHUNKS, help="DeepEP dispatch NVL chunk sizes")
    p.add_argument("--deepep-combine-chunks", default=DEFAULT_COMBINE_CHUNKS, help="DeepEP combine NVL chunk sizes")
    p.add_argument("--deepep-buffer-tokens", type=int, default=256, help="DeepEP NVL receive buffer (tokens)")
    p.add_argument("--deepep-tests", type=int, default=50, help="timed calls of a full measurement (DeepEP's bench)")
    p.add_argument("--deepep-warmup", type=int, default=50, help="warm-up calls of a full measurement")
    p.add_argument("--deepep-guard", type=int, choices=(0, 1), default=1,
                   help="1: check that none of our SM-for-SM calls wrote into DeepEP's buffer or barrier signals "
                        "(a snapshot before, a comparison after; ranks synchronised around each call)")
    p.add_argument("--deepep-topk-first", action="store_true",
                   help="time DeepEP's full dispatch (with top-k) before the SM-for-SM stage instead of after it")
    p.add_argument("--deepep-kernel-tokens", type=int, default=512,
                   help="up to this many tokens per rank, also the device time per call of both libraries' kernels "
                        "(torch profiler, DeepEP's bench_kineto method): what eager calls cost without the host")
    p.add_argument("--deepep-kernel-calls", type=int, default=20, help="profiled calls per kernel-time measurement")


def available() -> tuple[bool, str]:
    """(True, "") when ``deep_ep`` imports here, else (False, why)."""
    try:
        import deep_ep  # noqa: F401
    except Exception as e:  # ImportError, or a missing shared library behind it
        return False, f"deep_ep is not importable ({type(e).__name__}: {e})"
    return True, ""


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


class DeepEpNormal:
    """One DeepEP ``Buffer`` (NVLink part only) sized for every setting this run tries."""

    def __init__(self, group: Any, world: int, hidden: int, args: argparse.Namespace, sm_count: int) -> None:
        import deep_ep

        self.deep_ep = deep_ep
        self.world = world
        self.buffer_tokens = args.deepep_buffer_tokens
        self.sms = sorted({min(s, sm_count - sm_count % 2) for s in _ints(args.deepep_sms) if s >= 2 and s % 2 == 0})
        self.dispatch_chunks = [c for c in _ints(args.deepep_dispatch_chunks) if 0 < c < self.buffer_tokens]
        self.combine_chunks = [c for c in _ints(args.deepep_combine_chunks) if 0 < c < self.buffer_tokens]
        if not self.sms or not self.dispatch_chunks or not self.combine_chunks:
            raise ValueError("--deepep-sms and the chunk lists need at least one valid value each "
                             f"(even SM counts; chunks in [1, {self.buffer_tokens}))")
        biggest = max(self.dispatch_chunks + self.combine_chunks)
        nvl_bytes = max(self.config(s, biggest).get_nvl_buffer_size_hint(hidden * 2, world) for s in self.sms)
        self.buffer = deep_ep.Buffer(group, nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                                     explicitly_destroy=True)
        self.nvl_bytes = nvl_bytes

    def snapshot(self) -> tuple:
        """A copy of this rank's DeepEP NVLink buffer and its barrier signals (the ints right after
        it in the same allocation), taken when no kernel runs: what our calls must leave alone."""
        import torch

        whole = self.buffer.get_local_buffer_tensor(torch.uint8)
        signals = self.buffer.get_local_buffer_tensor(torch.int32, offset=self.nvl_bytes)[:_BARRIER_SIGNALS]
        return whole.clone(), signals.clone()

    def changed_since(self, snap: tuple) -> str:
        """Empty when the buffer and signals still hold ``snap``; else what differs (bytes, first offset)."""
        import torch

        whole = self.buffer.get_local_buffer_tensor(torch.uint8)
        signals = self.buffer.get_local_buffer_tensor(torch.int32, offset=self.nvl_bytes)[:_BARRIER_SIGNALS]
        diff = (whole != snap[0]).nonzero()
        out = []
        if diff.numel():
            out.append(f"{diff.numel()} bytes of the NVLink buffer, first at offset {int(diff[0])}")
        if not torch.equal(signals, snap[1]):
            out.append(f"barrier signals {snap[1].tolist()} -> {signals.tolist()}")
        return "; ".join(out)

    def config(self, sms: int, chunk: int) -> Any:
        """DeepEP ``Config`` of the intranode kernels (the RDMA fields are unused here)."""
        return self.deep_ep.Config(sms, chunk, self.buffer_tokens, 6, 128)

    def first_dispatch(self, x: Any, idx64: Any, w: Any, num_experts: int, sms: int) -> tuple:
        """A non-cached dispatch (layout, counts, CPU sync) at ``sms``: (recv_x, recv_w, handle)."""
        ntpr, _, ntpe, in_rank, _ = self.buffer.get_dispatch_layout(idx64, num_experts)
        recv_x, _, recv_w, _, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx64,
            topk_weights=w, config=self.config(sms, self.dispatch_chunks[0]))
        return recv_x, recv_w, handle, (ntpr, ntpe, in_rank)

    def destroy(self) -> None:
        self.buffer.destroy()


def _sorted_rows(keys: Any, rows: Any) -> Any:
    return rows[keys.argsort()]


def _deepep_keys(handle: Any, rank: int, stride: int) -> Any:
    """(source rank) * stride + (source token) of DeepEP's received rows (rows come grouped by
    source rank: rank_prefix_matrix[s][rank] = rows from sources <= s)."""
    import torch

    prefix, src_idx = handle[0][:, rank].to(torch.int64).contiguous(), handle[3].to(torch.int64)
    src_rank = torch.searchsorted(prefix, torch.arange(src_idx.numel(), device=src_idx.device), right=True)
    return src_rank * stride + src_idx


def compare(dp: DeepEpNormal, op: Any, n: int, data: dict, args: argparse.Namespace,
            sync: Callable[[], None]) -> list[dict]:
    """The DeepEP rows of one token count (collective: every rank runs the same calls).

    ``data``: ``idx`` (int32 routing), ``w``, ``x`` (bf16), ``x8``/``s8`` (FP8 tokens and scales,
    or None). Our combines take their expert outputs from a dispatch of their own (see ``ours``)."""
    import torch

    cfg = op.config
    rank, world = cfg.rank, cfg.world_size
    idx64 = data["idx"].to(torch.int64)
    x8, s8 = data.get("x8"), data.get("s8")
    full = (args.deepep_warmup, args.deepep_tests)
    reg = op.get_registered_combine_input_buffer(torch.bfloat16)
    rows: list[dict] = []

    def timed(fn: Callable[[], Any], calls: tuple[int, int], **row: Any) -> dict:
        return dict(row, table="deepep", tokens=n, **bench_like_deepep(fn, *calls))

    def ours(name: str, blocks: int = -1) -> Callable[[], Any]:
        """Our call ``name`` (blocks > 0: every kernel on that many blocks, SM for SM). Combines
        first re-run the BF16 dispatch whose routing state they use, and take their expert
        outputs (rows x (rank + 1)) from that dispatch: the receive order of a dispatch is not
        fixed (slots are reserved by atomics as the ranks' blocks arrive), so the rows of an
        earlier dispatch would sit in other slots and the combine would sum other tokens' rows."""
        w, idx = data["w"], data["idx"]
        if name == "dispatch bf16":
            return lambda: op.dispatch(data["x"], w, None, idx, block_num=blocks)
        if name == "dispatch fp8":
            return lambda: op.dispatch(x8, w, s8, idx, block_num=blocks)
        out, out_w, _, _, total = op.dispatch(data["x"], w, None, idx)
        torch.cuda.synchronize()
        recv = int(total[0])
        y = (out[:max(recv, 1)].to(torch.float32) * (rank + 1)).to(torch.bfloat16)
        out_w = out_w[:max(recv, 1)].clone()  # a peer's next dispatch may overwrite the op's copy
        reg[:recv].copy_(y[:recv])
        push = {"combine (default call)": -1, "combine push": 1, "combine pull": 0}[name]
        inp = reg if push == 0 else y
        return lambda: op.combine(inp, out_w, idx, block_num=blocks, use_external_inp_buf=push)

    dispatch_kinds = ["dispatch bf16"] + (["dispatch fp8"] if x8 is not None else [])
    combine_kinds = ["combine (default call)", "combine push", "combine pull"]
    for name in dispatch_kinds + combine_kinds:
        rows.append(timed(ours(name), full, lib="ours", kernel=name, sms=0))
    # Our combined rows of each call, for the check against DeepEP's below (a fresh dispatch each;
    # every rank finishes its combine before any rank's next dispatch writes into its buffers).
    ours_out = {}
    for name in combine_kinds:
        fn = ours(name)
        ours_out[name] = fn()[0][:n].clone()
        sync()
    # ---- DeepEP: per SM count, a first dispatch for the handle, then the chunk sweeps (quick)
    sweep: dict[tuple[str, int, int], float] = {}  # (kernel, SMs, chunk) -> this rank's quick mean
    state: dict[int, tuple] = {}
    y_dp = None
    for sms in dp.sms:
        progress(rank, f"{n} tokens: DeepEP at {sms} SMs (chunk sweep)")
        recv_x, recv_w, handle, layout = dp.first_dispatch(data["x"], idx64, data["w"],
                                                           cfg.num_experts_per_rank * world, sms)
        state[sms] = (handle, recv_w, layout)
        if y_dp is None:  # the same rows as ours (checked here), so the same expert: x (rank + 1)
            y_dp = (recv_x.to(torch.float32) * (rank + 1)).to(torch.bfloat16)
            rows += _dispatch_checks(dp, op, data, recv_x, handle, sms, rank, n, sync)
        for name in dispatch_kinds:
            xin = data["x"] if name == "dispatch bf16" else (x8, s8)
            for c in dp.dispatch_chunks:
                cfg_c = dp.config(sms, c)
                sweep[(name, sms, c)] = bench_like_deepep(
                    lambda: dp.buffer.dispatch(xin, handle=handle, config=cfg_c), *QUICK)["mean_us"]
        for c in dp.combine_chunks:
            cfg_c = dp.config(sms, c)
            sweep[("combine", sms, c)] = bench_like_deepep(
                lambda: dp.buffer.combine(y_dp, handle, topk_weights=recv_w, config=cfg_c), *QUICK)["mean_us"]
    best = _agreed_best(sweep)

    def full_dispatches() -> None:
        """DeepEP's full dispatch (with top-k, no CPU sync) at its best SM count and chunk."""
        if args.deepep_guard:
            sync()
        for name in dispatch_kinds:
            sms = min(dp.sms, key=lambda s: best[(name, s)][0])
            progress(rank, f"{n} tokens: DeepEP full dispatch with top-k ({name}, {sms} SMs)")
            ntpr, ntpe, in_rank = state[sms][2]
            xin = data["x"] if name == "dispatch bf16" else (x8, s8)
            cfg_c = dp.config(sms, best[(name, sms)][1])
            fn = lambda: dp.buffer.dispatch(xin, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,  # noqa: E731
                                            num_tokens_per_expert=ntpe, topk_idx=idx64, topk_weights=data["w"],
                                            num_worst_tokens=n * world, config=cfg_c)
            rows.append(timed(fn, full, lib="deepep", kernel=name + " (with top-k)", sms=sms,
                              chunk=best[(name, sms)][1]))

    if args.deepep_topk_first:
        full_dispatches()
    # ---- every SM count at its best chunk, in full; ours SM for SM (block_num = SMs)
    progress(rank, f"{n} tokens: DeepEP best chunks in full, ours SM for SM")
    for name in dispatch_kinds + ["combine"]:
        for sms in dp.sms:
            handle, recv_w, _ = state[sms]
            chunk = best[(name, sms)][1]
            cfg_c = dp.config(sms, chunk)
            if name == "combine":
                fn = lambda: dp.buffer.combine(y_dp, handle, topk_weights=recv_w, config=cfg_c)  # noqa: E731
            else:
                xin = data["x"] if name == "dispatch bf16" else (x8, s8)
                fn = lambda: dp.buffer.dispatch(xin, handle=handle, config=cfg_c)  # noqa: E731
            progress(rank, f"{n} tokens: SM for SM, DeepEP {name} at {sms} SMs")
            rows.append(timed(fn, full, lib="deepep", kernel=name, sms=sms, chunk=chunk))
            progress(rank, f"{n} tokens: SM for SM, ours {name} at block_num {sms}")
            mine = "combine (default call)" if name == "combine" else name
            # Guard: our calls must not write into DeepEP's memory (a DeepEP dispatch after this
            # stage faulted in some runs; this tells whether anything of ours touched its buffer).
            if args.deepep_guard:
                sync()
                before = dp.snapshot()
            rows.append(timed(ours(mine, sms), full, lib="ours", kernel=mine, sms=sms))
            if args.deepep_guard:
                sync()
                changed = dp.changed_since(before)
                rows.append(dict(table="deepep_check", tokens=n, max_abs_diff=0.0, equal=not changed,
                                 what=f"DeepEP buffer untouched by ours: {mine}, {sms} SMs"))
                if changed:
                    raise RuntimeError(f"rank {rank}: our {mine} at block_num {sms} changed DeepEP's buffer: {changed}")
                del before
                sync()  # no rank's next DeepEP call (its barrier writes the peers' signals) before every rank compared
    op.check_error()
    if not args.deepep_topk_first:
        full_dispatches()
    if n <= args.deepep_kernel_tokens:
        rows += _kernel_times(dp, ours, data, y_dp, dispatch_kinds, combine_kinds, best, state, n, args, rank)
    # ---- the combined rows of both libraries, same expert on both sides
    progress(rank, f"{n} tokens: DeepEP checks")
    sms = dp.sms[0]
    handle, recv_w, _ = state[sms]
    dp_out = dp.buffer.combine(y_dp, handle, topk_weights=recv_w, config=dp.config(sms, best[("combine", sms)][1]))[0]
    torch.cuda.synchronize()
    for name in combine_kinds:
        rows.append(_check(f"combine output (bf16), ours: {name[8:]}", n, ours_out[name], dp_out[:n]))
    op.check_error()
    sync()
    return rows


def _kernel_times(dp: DeepEpNormal, ours: Callable[[str], Callable[[], Any]], data: dict, y_dp: Any,
                  dispatch_kinds: list[str], combine_kinds: list[str], best: dict, state: dict, n: int,
                  args: argparse.Namespace, rank: int) -> list[dict]:
    """Device time per call of every kernel a call launches (``measure.kernel_breakdown``: the
    torch profiler, DeepEP's own tests' kernel timer), ours and DeepEP's at its agreed best SM count
    and chunk (collective). At small batches an eager call can cost the host more than its kernels
    take; these rows show the kernels alone, each library's on the same data."""
    out = []
    calls = max(2, args.deepep_kernel_calls)

    def device_us(fn: Callable[[], Any]) -> tuple[float, str]:
        parts = kernel_breakdown(fn, calls)
        total = sum(us * per_call for us, per_call in parts.values())
        return total, "; ".join(f"{k.split('(')[0][-40:]} x{per_call:g}" for k, (_, per_call) in parts.items())

    x8, s8 = data.get("x8"), data.get("s8")
    for name in dispatch_kinds + ["combine"]:
        sms = min(dp.sms, key=lambda s: best[(name, s)][0])
        handle, recv_w, _ = state[sms]
        cfg_c = dp.config(sms, best[(name, sms)][1])
        if name == "combine":
            theirs = lambda: dp.buffer.combine(y_dp, handle, topk_weights=recv_w, config=cfg_c)  # noqa: E731
            mine = combine_kinds
        else:
            xin = data["x"] if name == "dispatch bf16" else (x8, s8)
            theirs = lambda: dp.buffer.dispatch(xin, handle=handle, config=cfg_c)  # noqa: E731
            mine = [name]
        progress(rank, f"{n} tokens: kernel times, {name}")
        dp_us, dp_kernels = device_us(theirs)
        for m in mine:
            us, kernels = device_us(ours(m))
            out.append(dict(table="deepep_kernels", tokens=n, call=m, ours_us=us, ours_kernels=kernels,
                            deepep_us=dp_us, deepep_kernels=dp_kernels, sms=sms, chunk=best[(name, sms)][1]))
    return out


def _agreed_best(sweep: dict[tuple[str, int, int], float], device: str = "cuda") -> dict[tuple[str, int], tuple[float, int]]:
    """(kernel, SMs) -> (mean us over ranks, chunk) of the fastest chunk, the same on every rank.

    DeepEP's calls are collective: every rank must run them with the same SM count and chunks. A
    choice made from each rank's own timings differs between ranks now and then (their times are
    within noise of each other), and DeepEP then runs with mismatched channel counts, which hangs
    or faults (an illegal address in its full dispatch). So the ranks' times are averaged first
    (collective over the default process group; ``device``: where its backend reduces tensors)."""
    import torch
    import torch.distributed as dist

    keys = sorted(sweep)
    times = torch.tensor([sweep[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(times)
    dist.broadcast(times, src=0)  # bit for bit the same on every rank, whatever the reduction order
    times /= dist.get_world_size()
    best: dict[tuple[str, int], tuple[float, int]] = {}
    for (name, sms, chunk), t in zip(keys, times.tolist()):
        if (name, sms) not in best or t < best[(name, sms)][0]:
            best[(name, sms)] = (t, chunk)
    return best


def _check(what: str, n: int, ours: Any, theirs: Any) -> dict:
    """A check row: bit-equality of two tensors and their largest difference."""
    import torch

    same_shape = tuple(ours.shape) == tuple(theirs.shape)
    equal = same_shape and bool(torch.equal(ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8)))
    diff = float("nan")
    if same_shape:
        diff = float((ours.float() - theirs.float()).abs().max()) if ours.numel() else 0.0
    return dict(table="deepep_check", tokens=n, what=what, equal=equal, max_abs_diff=diff)


def _dispatch_checks(dp: DeepEpNormal, op: Any, data: dict, recv_x: Any, handle: Any, sms: int, rank: int,
                     n: int, sync: Callable[[], None]) -> list[dict]:
    """Our dispatched rows and DeepEP's, both ordered by (source rank, source token): BF16, and
    FP8 with its scales (DeepEP's cached dispatch of the same handle).

    Our outputs are views of the op's receive buffers, which the peers' next dispatch writes:
    they are copied, and every rank has copied them (``sync``), before the next dispatch."""
    import torch

    stride = op.max_num_tokens_to_send()
    keys = _deepep_keys(handle, rank, stride)
    out = op.dispatch(data["x"], data["w"], None, data["idx"])[0]
    pos = op.get_dispatch_src_token_pos().to(torch.int64)
    mine = out[: pos.numel()].clone()
    sync()
    checks = [_check("dispatch rows (bf16)", n, _sorted_rows(pos, mine), _sorted_rows(keys, recv_x))]
    if data.get("x8") is not None:
        out8, _, scales8, _, _ = op.dispatch(data["x8"], data["w"], data["s8"], data["idx"])
        pos = op.get_dispatch_src_token_pos().to(torch.int64)
        out8, scales8 = out8[: pos.numel()].clone(), scales8[: pos.numel()].clone()
        sync()
        rx8, rs8 = dp.buffer.dispatch((data["x8"], data["s8"]), handle=handle,
                                      config=dp.config(sms, dp.dispatch_chunks[0]))[0]
        checks.append(_check("dispatch rows (fp8)", n, _sorted_rows(pos, out8[: pos.numel()]), _sorted_rows(keys, rx8)))
        checks.append(_check("dispatch scales (fp8)", n, _sorted_rows(pos, scales8[: pos.numel()]),
                             _sorted_rows(keys, rs8)))
    return checks


# ----------------------------------------------------------------------------- tables
def merged_rows(per_rank: dict[int, list[dict]], table: str) -> list[dict]:
    """Rows of ``table`` merged over ranks (row i of every rank: times averaged, checks all-equal
    and the largest difference)."""
    import statistics

    ranks = sorted(per_rank)
    per = {r: [x for x in per_rank[r] if x.get("table") == table] for r in ranks}
    out = []
    for i, row in enumerate(per[ranks[0]]):
        rs = [per[r][i] for r in ranks]
        if table == "deepep_check":
            out.append(dict(row, equal=all(r["equal"] for r in rs), max_abs_diff=max(r["max_abs_diff"] for r in rs)))
        else:
            keys = ("mean_us", "median_us", "host_us") + (("loop_us",) if all("loop_us" in r for r in rs) else ())
            out.append(dict(row, **{k: statistics.mean(r[k] for r in rs) for k in keys}))
    return out


def merged_kernel_rows(per_rank: dict[int, list[dict]]) -> list[dict]:
    """The kernel-time rows (``deepep_kernels``) merged over ranks: device times averaged."""
    import statistics

    ranks = sorted(per_rank)
    per = {r: [x for x in per_rank[r] if x.get("table") == "deepep_kernels"] for r in ranks}
    return [dict(row, **{k: statistics.mean(per[r][i][k] for r in ranks) for k in ("ours_us", "deepep_us")})
            for i, row in enumerate(per[ranks[0]])]


def ours_vs_best(rows: list[dict]) -> list[dict]:
    """Per token count and call: our time at the op's launch and DeepEP's best (SM count and chunk)
    of the same kind (combines against DeepEP's combine), as dicts with ``ratio`` = DeepEP / ours."""
    out = []
    for r in rows:
        if r["lib"] != "ours" or r["sms"] != 0:
            continue
        kind = "combine" if r["kernel"].startswith("combine") else r["kernel"]
        theirs = [d for d in rows if d["lib"] == "deepep" and d["kernel"] == kind and d["tokens"] == r["tokens"]]
        if not theirs:
            continue
        best = min(theirs, key=lambda d: d["mean_us"])
        topk = [d for d in rows if d["lib"] == "deepep" and d["kernel"] == kind + " (with top-k)" and
                d["tokens"] == r["tokens"]]
        out.append(dict(tokens=r["tokens"], kernel=r["kernel"], ours=r, deepep=best,
                        deepep_topk=topk[0] if topk else None, ratio=best["mean_us"] / r["mean_us"]))
    return out


def print_tables(per_rank: dict[int, list[dict]], title: str) -> list[dict]:
    """The comparison tables (best vs best, SM for SM, checks); returns ``ours_vs_best`` rows."""
    from mori_core.bench.table import print_table

    rows = merged_rows(per_rank, "deepep")
    if not rows:
        return []
    best = ours_vs_best(rows)
    print_table(
        title + ": ours vs DeepEP at its best (same processes, same data; DeepEP's bench(): L2 flushed, "
        "event pair per call, mean over ranks)",
        ["tokens", "call", "ours mean us", "ours median us", "ours host us", "ours loop us", "DeepEP SMs", "chunk",
         "DeepEP mean us", "DeepEP host us", "DeepEP loop us", "DeepEP / ours", "DeepEP with top-k us"],
        [[b["tokens"], b["kernel"], b["ours"]["mean_us"], b["ours"]["median_us"], b["ours"]["host_us"],
          b["ours"].get("loop_us", "-"), b["deepep"]["sms"], b["deepep"]["chunk"], b["deepep"]["mean_us"],
          b["deepep"]["host_us"], b["deepep"].get("loop_us", "-"), f"{b['ratio']:.2f}x",
          b["deepep_topk"]["mean_us"] if b["deepep_topk"] else "-"] for b in best],
        note="DeepEP dispatch = its cached dispatch (handle of a first dispatch: no layout kernel, no CPU sync; "
             "rows and scales only); 'with top-k' = its full dispatch with top-k ids and weights "
             "(num_worst_tokens, no CPU sync) at the same setting; ours always carries ids, weights and scales. "
             "loop = host wall time per timed iteration (call + two event records; >= the latency: host-bound). "
             "Ratio > 1: ours is faster.")
    sm_rows = []
    for d in rows:
        if d["lib"] != "deepep" or d["sms"] == 0 or "top-k" in d["kernel"]:
            continue
        mine = "combine (default call)" if d["kernel"] == "combine" else d["kernel"]
        o = [r for r in rows if r["lib"] == "ours" and r["kernel"] == mine and r["sms"] == d["sms"] and
             r["tokens"] == d["tokens"]]
        if o:
            sm_rows.append([d["tokens"], mine, d["sms"], d["chunk"], d["mean_us"], o[0]["mean_us"],
                            f"{d['mean_us'] / o[0]['mean_us']:.2f}x"])
    print_table(title + ": SM for SM (ours with block_num = DeepEP's SM count)",
                ["tokens", "call", "SMs", "DeepEP chunk", "DeepEP mean us", "ours mean us", "DeepEP / ours"], sm_rows)
    kernels = merged_kernel_rows(per_rank)
    if kernels:
        print_table(title + ": device time per call, kernels alone (torch profiler; DeepEP at its agreed best setting)",
                    ["tokens", "call", "ours us", "DeepEP us", "DeepEP / ours", "DeepEP SMs", "chunk", "ours kernels",
                     "DeepEP kernels"],
                    [[k["tokens"], k["call"], k["ours_us"], k["deepep_us"], f"{k['deepep_us'] / k['ours_us']:.2f}x",
                      k["sms"], k["chunk"], k["ours_kernels"], k["deepep_kernels"]] for k in kernels],
                    note="sum over the kernels a call launches of (mean device time x launches per call), mean over "
                         "ranks; with the eager table above it shows how much of an eager call is host time")
    checks = merged_rows(per_rank, "deepep_check")
    print_table(title + ": same data, both libraries", ["tokens", "what", "equal on every rank", "max |diff|"],
                [[c["tokens"], c["what"], "yes" if c["equal"] else "NO", c["max_abs_diff"]] for c in checks])
    return best
