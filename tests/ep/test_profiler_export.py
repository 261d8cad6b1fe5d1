"""The EP kernel profiler's trace export (plain Python) on a synthetic event buffer.

The buffer format is the one the kernels write (ops/ep_profiler.cuh): int64 (globaltimer ns,
meta) pairs, meta = kind | phase << 2 | warp << 8 | block << 16 | round << 32, zeros unused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import mori.kernel_profiler
from mori_core.ops.profiler import default_phase_names, export_to_perfetto, parse_trace

PHASES = default_phase_names()


def _meta(kind: int, phase: str, warp: int, block: int, rnd: int) -> int:
    value = kind | (PHASES.index(phase) << 2) | (warp << 8) | (block << 16) | (rnd << 32)
    return value - (1 << 64) if value >= 1 << 63 else value


def _buffer() -> torch.Tensor:
    """Two warps of one dispatch (round 7) then a combine (round 3), slots as the kernels fill them."""
    ev = []
    t = 1_000_000
    for block, warp in ((0, 0), (1, 2)):
        seq = [("dispatch_route", 0, 100), ("dispatch_route", 1, 400), ("dispatch_copy", 0, 450), ("dispatch_copy", 1, 2400)]
        ev.append([(t + dt + 10 * block, _meta(k, p, warp, block, 7)) for p, k, dt in seq])
    ev[1].append((t + 2500, _meta(0, "dispatch_signal", 2, 1, 7)))
    ev[1].append((t + 6000, _meta(1, "dispatch_signal", 2, 1, 7)))
    c = t + 9000
    ev[0] += [(c, _meta(0, "combine_stage", 0, 0, 3)), (c + 800, _meta(1, "combine_stage", 0, 0, 3)),
              (c + 810, _meta(0, "combine_barrier", 0, 0, 3)), (c + 1500, _meta(1, "combine_barrier", 0, 0, 3)),
              (c + 1510, _meta(0, "combine_reduce", 0, 0, 3)), (c + 4000, _meta(1, "combine_reduce", 0, 0, 3)),
              (c + 4100, _meta(1, "combine_reduce", 0, 0, 9))]  # an end without a begin: dropped
    buf = torch.zeros(4, 16, 2, dtype=torch.int64)  # 4 warp slots x 16 events
    for slot, events in enumerate(ev):
        for i, (ts, meta) in enumerate(events):
            buf[slot, i, 0], buf[slot, i, 1] = ts, meta
    return buf.view(-1)


def test_parse_pairs_events_per_warp() -> None:
    spans, dropped = parse_trace(_buffer())
    assert dropped == 1
    names = [s.phase for s in spans]
    assert names.count("dispatch_route") == 2 and names.count("dispatch_copy") == 2
    assert {s.round for s in spans if s.phase.startswith("dispatch")} == {7}
    sig = next(s for s in spans if s.phase == "dispatch_signal")
    assert (sig.block, sig.warp, sig.end_ns - sig.begin_ns) == (1, 2, 3500)


def test_export_writes_ordered_perfetto_json(tmp_path: Path) -> None:
    path = tmp_path / "ep_trace.json"
    n = mori.kernel_profiler.export_to_perfetto(_buffer(), str(path), rank=3)
    doc = json.loads(path.read_text())
    phases = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert n == len(phases) == 8
    assert {e["pid"] for e in doc["traceEvents"]} == {3}
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {"block 0 warp 0", "block 1 warp 2"}
    first = {}
    for e in phases:
        first.setdefault(e["name"], e["ts"])
        assert e["dur"] > 0
    assert first["dispatch_route"] == 0.0  # microseconds from the first event
    assert first["dispatch_route"] < first["dispatch_copy"] < first["dispatch_signal"] < first["combine_stage"]
    assert first["combine_stage"] < first["combine_barrier"] < first["combine_reduce"]
    assert doc["otherData"]["unmatched_events"] == 1


def test_empty_buffer_exports_no_events(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    assert export_to_perfetto(torch.zeros(64, dtype=torch.int64), str(path)) == 0
    assert [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"] == []
