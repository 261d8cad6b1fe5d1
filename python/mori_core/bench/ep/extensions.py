"""FP8-combine and standard-MoE rows of the IntraNode EP benchmark.

``python -m mori_core.bench ep --fp8-combine [--std-moe]`` adds, per token count:

* FP8 combine (``quant_type`` fp8_direct_cast and fp8_blockwise, push and pull) next to the BF16
  combine re-timed in the same run on the same routing and expert outputs (identity experts).
  Bandwidth is reported two ways: **link GB/s** counts the bytes that cross NVLink (rows from
  other ranks: e4m3 payload + block scales for FP8, bf16 for BF16; a rank's own rows are read in
  place and not counted), **effective GB/s** counts the BF16 payload MORI's benchmark counts
  (received rows x hidden x 2, own rows included), so its ratio to BF16 is the speed-up. The error
  is the FP8 result against the BF16 combine of the same inputs (relative L2 and max |diff|).
* Standard-MoE layout (``--std-moe``, token counts up to 512: the 3-D buffers hold
  ``experts_per_rank x world x tokens`` rows): dispatch_standard_moe / combine_standard_moe next
  to the plain dispatch / combine of the same op. ``--std-moe-paths 0,1,2`` also times each of
  those ``MORI_EP_STD_FUSED`` paths (0 three launches, 1 two, 2 one) on an op of its own, in the
  same run (rows ``... [MORI_EP_STD_FUSED=v]``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
from typing import Any, Callable

from mori_core.bench.ep.measure import timing_columns_note
from mori_core.placement import Placement

STD_MAX_TOKENS = 512
STD_PATH_ENV = "MORI_EP_STD_FUSED"
QUANT_TYPES = ("fp8_direct_cast", "fp8_blockwise")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the extension rows."""
    p.add_argument("--fp8-combine", action="store_true", help="also time FP8 combine (both quant types, push and pull)")
    p.add_argument("--std-moe", action="store_true",
                   help=f"also time dispatch/combine_standard_moe (token counts <= {STD_MAX_TOKENS})")
    p.add_argument("--std-moe-paths", default="",
                   help=f"with --std-moe: comma-separated {STD_PATH_ENV} values (0, 1, 2) also timed, one op each")
    p.add_argument("--std-kernel-times", action="store_true",
                   help="with --std-moe: rows of each kernel's device time in the 2-D and 3-D dispatch (torch "
                        "profiler, DeepEP's timer), to show where the 3-D path's extra time goes")


def extension_rows(op: Any, cfg: Any, args: argparse.Namespace, n: int, x: Any, w: Any, idx: Any,
                   measure: Callable[..., dict], sync: Callable) -> list[dict]:
    """Rows for one token count (collective: every rank calls it with its own inputs).

    ``measure(fn, args, sync, **row)`` is the EP benchmark's timer: it returns ``row`` with the
    eager/graph/host times (``us`` = the graph time, or eager with ``--no-graph``)."""
    rows: list[dict] = []
    if getattr(args, "fp8_combine", False):
        rows += _fp8_rows(op, cfg, args, n, x, w, idx, measure, sync)
    if getattr(args, "std_moe", False) and n <= STD_MAX_TOKENS:
        rows += _std_rows(cfg, args, n, x, w, idx, measure, sync)
    return rows


def _rows_from_peers(op: Any) -> tuple[int, int]:
    """(rows received by the last dispatch, how many came from other ranks)."""
    pos = op.get_dispatch_src_token_pos().long()
    src = pos // op.max_num_tokens_to_send()
    return int(pos.numel()), int((src != op.config.rank).sum())


def _combine_once(op: Any, y: Any, w: Any, idx: Any, push: bool) -> Any:
    return op.combine(y if push else op.get_registered_combine_input_buffer(y.dtype), w, idx,
                      use_external_inp_buf=int(push))[0]


def _fp8_rows(op: Any, cfg: Any, args: argparse.Namespace, n: int, x: Any, w: Any, idx: Any,
              measure: Callable[..., dict], sync: Callable) -> list[dict]:
    import torch

    from mori_core.ops import EpDispatchCombineOp
    from mori_core.ops.combine_quant import combine_quant_code, link_bytes_per_row

    h = x.shape[1]
    out: list[dict] = []
    ops = [("bf16", op)] + [(q, EpDispatchCombineOp(dataclasses.replace(cfg, quant_type=q))) for q in QUANT_TYPES]
    try:
        baseline = {}
        for name, o in ops:
            res = o.dispatch(x, w, None, idx)
            torch.cuda.synchronize()
            recv, crossing = _rows_from_peers(o)
            y = res[0][: max(recv, 1)].clone()
            o.get_registered_combine_input_buffer(torch.bfloat16)[:recv].copy_(y[:recv])
            quant = combine_quant_code(o.config)
            for push in (True, False):
                fn = lambda: _combine_once(o, y, res[1], idx, push)  # noqa: E731 - timed closure
                result = fn()[:n].float()
                torch.cuda.synchronize()
                p = o._cached_combine_launch
                mode = "push" if push else "pull"
                row = measure(fn, args, sync, kernel=f"combine {name}", dtype="bf16" if name == "bf16" else "fp8",
                              tokens=n, recv=recv, bytes=recv * h * 2, blocks=p.block_num, warps=p.warp_per_block,
                              mode=mode, ext="fp8", link_bytes=crossing * link_bytes_per_row(h, 2, quant),
                              crossing=crossing)
                if name == "bf16":
                    baseline[mode] = (result, row["us"])
                ref, ref_us = baseline[mode]
                err = (result - ref).norm() / max(float(ref.norm()), 1e-30)
                row.update(speedup=ref_us / row["us"], rel_err=float(err),
                           max_err=float((result - ref).abs().max()) if n else 0.0)
                out.append(row)
            o.check_error()
    finally:
        sync()
        for name, o in ops[1:]:
            o.close()
    return out


@contextlib.contextmanager
def _std_path(value: str | None):
    """MORI_EP_STD_FUSED=value while an op is built (it reads it then); None: as the run has it."""
    saved = os.environ.get(STD_PATH_ENV)
    if value is not None:
        os.environ[STD_PATH_ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(STD_PATH_ENV, None)
        else:
            os.environ[STD_PATH_ENV] = saved


def _std_rows(cfg: Any, args: argparse.Namespace, n: int, x: Any, w: Any, idx: Any, measure: Callable[..., dict],
              sync: Callable) -> list[dict]:
    rows = _std_path_rows(cfg, args, n, x, w, idx, measure, sync, None)
    for value in [v.strip() for v in getattr(args, "std_moe_paths", "").split(",") if v.strip()]:
        rows += _std_path_rows(cfg, args, n, x, w, idx, measure, sync, value)
    return rows


def _std_path_rows(cfg: Any, args: argparse.Namespace, n: int, x: Any, w: Any, idx: Any,
                   measure: Callable[..., dict], sync: Callable, path: str | None) -> list[dict]:
    """The standard-MoE rows on an op built with MORI_EP_STD_FUSED=path (None: the run's setting,
    with the 2-D rows of the same op); the path's rows are named after it."""
    import torch

    from mori_core.ops import EpDispatchCombineOp

    h = x.shape[1]
    with _std_path(path):
        op = EpDispatchCombineOp(dataclasses.replace(cfg, max_num_inp_token_per_rank=max(n, 1), scale_dim=0))
    tag = "" if path is None else f" [{STD_PATH_ENV}={path}]"
    rows: list[dict] = []
    try:
        packed, count, _, _ = op.dispatch_standard_moe(x, w, None, idx)
        torch.cuda.synchronize()
        packed_rows = int(count.sum())
        y3 = packed.clone()
        res = op.dispatch(x, w, None, idx)
        torch.cuda.synchronize()
        recv = int(res[4][0])
        y2 = res[0][: max(recv, 1)].clone()
        timed = [
            ("dispatch (same op)", lambda: op.dispatch(x, w, None, idx), recv),
            ("dispatch_standard_moe", lambda: op.dispatch_standard_moe(x, w, None, idx), packed_rows),
            ("dispatch + combine push (same op)", lambda: (op.dispatch(x, w, None, idx), op.combine(y2, None, idx)), recv),
            ("dispatch_standard_moe + combine_standard_moe",
             lambda: (op.dispatch_standard_moe(x, w, None, idx), op.combine_standard_moe(y3, None, idx)), packed_rows),
        ]
        if path is not None:
            timed = [(name + tag, fn, nrows) for name, fn, nrows in timed if "standard_moe" in name]
        for name, fn, nrows in timed:
            rows.append(measure(fn, args, sync, kernel=name, dtype="bf16", tokens=n, recv=nrows, bytes=nrows * h * 2,
                                blocks=0, warps=0, mode="std", ext="std"))
        if path is None and getattr(args, "std_kernel_times", False):
            rows += _kernel_rows(timed[:2], n, sync)
        op.check_error()
    finally:
        sync()
        op.close()
    return rows


def _kernel_rows(timed: list, n: int, sync: Callable) -> list[dict]:
    """Rows of each kernel's mean device time per call (launches per call x time per launch) of
    the given (name, fn, rows) calls; every rank emits the same rows (sorted kernel names)."""
    from mori_core.bench.ep.measure import kernel_breakdown

    rows = []
    for name, fn, _ in timed:
        sync()
        times = kernel_breakdown(fn, 20)
        for key in sorted(times):
            us, per_call = times[key]
            short = key.split("(")[0].split("<")[0].split("::")[-1]
            rows.append(dict(kernel=f"{name}: kernel {short} (x{per_call:g} per call)", dtype="bf16", tokens=n,
                             recv=0, bytes=0, blocks=0, warps=0, mode="std", ext="std", eager_us=us * per_call,
                             eager_mean_us=us * per_call, host_us=0.0, us=us * per_call, graph_us=None))
    return rows


def print_extension_tables(per_rank: dict[int, list[dict]], title: str, where: Placement) -> None:
    """FP8-combine and standard-MoE tables (rows averaged over ranks; errors: worst rank). With
    ranks sharing a GPU only the FP8 errors are printed (times mean nothing there)."""
    from mori_core.bench.table import print_table

    ranks = sorted(per_rank)
    first = per_rank[ranks[0]]
    for kind in ("fp8", "std"):
        idx = [i for i, r in enumerate(first) if r.get("ext") == kind]
        if not idx:
            continue
        table = []
        for i in idx:
            rs = [per_rank[r][i] for r in ranks]
            us = statistics.mean(r["us"] for r in rs)
            eff = statistics.mean(r["bytes"] / (r["us"] * 1e-6) / 1e9 for r in rs)
            if kind == "fp8":
                link = statistics.mean(r["link_bytes"] / (r["us"] * 1e-6) / 1e9 for r in rs)
                table.append([rs[0]["kernel"], rs[0]["mode"], rs[0]["tokens"], round(statistics.mean(r["recv"] for r in rs)),
                              round(statistics.mean(r["crossing"] for r in rs)), f"{rs[0]['blocks']}x{rs[0]['warps']}",
                              statistics.mean(r["eager_us"] for r in rs), us, link, eff, f"{statistics.mean(r['speedup'] for r in rs):.2f}x",
                              f"{max(r['rel_err'] for r in rs):.2e}", f"{max(r['max_err'] for r in rs):.3g}"])
            else:
                table.append([rs[0]["kernel"], rs[0]["tokens"], round(statistics.mean(r["recv"] for r in rs)),
                              statistics.mean(r["eager_us"] for r in rs), us, eff])
        if where.shared:
            if kind == "fp8":  # the numerics still count: mode, tokens and the error columns
                print_table(title + ": FP8 combine vs BF16 combine (errors only)",
                            ["combine", "mode", "tokens", "rel L2 err vs bf16", "max abs err"],
                            [[r[0], r[1], r[2], r[-2], r[-1]] for r in table], note=timing_columns_note(where))
            continue
        if kind == "fp8":
            print_table(title + ": FP8 combine vs BF16 combine (same run, same routing and expert outputs)",
                        ["combine", "mode", "tokens", "recv/rank", "rows over link", "blocks x warps", "eager us", "graph us",
                         "link GB/s", "effective GB/s", "speed-up vs bf16", "rel L2 err vs bf16", "max abs err"], table,
                        note="times: graph replay (eager without graphs); link GB/s = bytes crossing NVLink (payload + "
                             "scales of other ranks' rows) / time; effective GB/s = received rows x hidden x 2 / time "
                             "(the BF16 payload, MORI's count); at EP1 no row crosses a link (link GB/s 0)")
        else:
            print_table(title + ": standard-MoE layout (3-D) vs the 2-D path of the same op",
                        ["kernel(s)", "tokens", "rows/rank", "eager us", "graph us", "GB/s (rows x hidden x 2, graph)"], table)
