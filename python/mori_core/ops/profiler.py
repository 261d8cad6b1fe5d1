"""EP kernel profiler: per-warp phase timestamps and their Chrome/Perfetto JSON trace.

Builds configured with ``-DMORI_ENABLE_PROFILER=ON`` (pip: ``-Ccmake.define.MORI_ENABLE_PROFILER=ON``)
make lane 0 of every warp of the EP kernels record ``(globaltimer ns, meta)`` pairs at the start and
end of each phase (names: ``mori_core.build_info()["ep_profiler_phases"]``) into an int64 device
buffer of the op: ``op.get_debug_time_buf()`` (or MORI's ``mori.cpp.get_debug_time_buf(op._handle)``).
In normal builds the recording is compiled out.

``meta = kind | phase << 2 | warp << 8 | block << 16 | round << 32`` (kind 0 = begin, 1 = end;
round = the op's dispatch or combine call number). Unused slots hold zeros.
:func:`export_to_perfetto` turns a buffer into a trace with one track per (rank, block, warp) and
one complete event per phase (open it at https://ui.perfetto.dev or chrome://tracing).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

PROFILER_BUILD_HINT = (
    "this mori_core build has no kernel profiler; rebuild with "
    "`pip install . -Ccmake.define.MORI_ENABLE_PROFILER=ON` (CMake -DMORI_ENABLE_PROFILER=ON)"
)


@dataclass(frozen=True)
class PhaseSpan:
    """One completed phase of one warp."""

    phase: str
    block: int
    warp: int
    round: int
    begin_ns: int
    end_ns: int


def default_phase_names() -> list[str]:
    """Phase names of this build's kernels (index = phase id)."""
    from mori_core import _C

    return list(_C.build_info()["ep_profiler_phases"])


def parse_trace(buf: Any, phase_names: Optional[Sequence[str]] = None) -> tuple[list[PhaseSpan], int]:
    """Pair the begin/end events of a profiler buffer into spans.

    Args:
        buf: the int64 buffer (torch tensor on any device, numpy array or sequence) of
            ``(time ns, meta)`` pairs.
        phase_names: names by phase id; default :func:`default_phase_names`.

    Returns:
        ``(spans sorted by begin time, number of unmatched events dropped)``.
    """
    names = list(phase_names) if phase_names is not None else default_phase_names()
    t = torch.as_tensor(buf).detach().to("cpu", torch.int64).reshape(-1)
    if t.numel() % 2:
        raise ValueError(f"a profiler buffer holds (time, meta) pairs; got {t.numel()} values")
    pairs = t.view(-1, 2)
    pairs = pairs[pairs[:, 0] != 0]
    open_events: dict[tuple, list[int]] = defaultdict(list)
    spans: list[PhaseSpan] = []
    dropped = 0
    for ts, meta in sorted(((int(a), int(b) & 0xFFFFFFFFFFFFFFFF) for a, b in pairs.tolist()), key=lambda x: x[0]):
        kind, phase = meta & 0x3, (meta >> 2) & 0x3F
        warp, block, rnd = (meta >> 8) & 0xFF, (meta >> 16) & 0xFFFF, meta >> 32
        key = (phase, block, warp, rnd)
        if kind == 0:
            open_events[key].append(ts)
        elif open_events[key]:
            begin = open_events[key].pop()
            name = names[phase] if phase < len(names) else f"phase_{phase}"
            spans.append(PhaseSpan(name, block, warp, rnd, begin, ts))
        else:
            dropped += 1
    dropped += sum(len(v) for v in open_events.values())
    spans.sort(key=lambda s: (s.begin_ns, s.end_ns))
    return spans, dropped


def export_to_perfetto(
    trace_buffer: Any,
    filename: str = "trace.json",
    phase_names: Optional[Sequence[str]] = None,
    rank: int = 0,
) -> int:
    """Write a Chrome/Perfetto JSON trace of a profiler buffer (MORI's ``export_to_perfetto``).

    Args:
        trace_buffer: ``op.get_debug_time_buf()`` / ``mori.cpp.get_debug_time_buf(op._handle)``.
        filename: the JSON file to write.
        phase_names: names by phase id; default: this build's.
        rank: the process id of the trace (use the EP rank when merging several ranks' traces).

    Returns:
        The number of phase events written. Times are microseconds from the first event.
    """
    spans, dropped = parse_trace(trace_buffer, phase_names)
    t0 = spans[0].begin_ns if spans else 0
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"EP rank {rank}"}}]
    tracks = sorted({(s.block, s.warp) for s in spans})
    for block, warp in tracks:
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": block * 256 + warp,
                       "args": {"name": f"block {block} warp {warp}"}})
    for s in spans:
        events.append({
            "name": s.phase,
            "cat": s.phase.split("_")[0],
            "ph": "X",
            "ts": (s.begin_ns - t0) / 1000.0,
            "dur": (s.end_ns - s.begin_ns) / 1000.0,
            "pid": rank,
            "tid": s.block * 256 + s.warp,
            "args": {"block": s.block, "warp": s.warp, "round": s.round},
        })
    with open(filename, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns",
                   "otherData": {"source": "mori_core EP kernel profiler", "unmatched_events": dropped}}, f)
    return len(spans)

