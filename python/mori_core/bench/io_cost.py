"""Where the host time of one transfer call goes (``bench io --breakdown``).

The core stamps CLOCK_MONOTONIC at the stages of a submission on the calling
thread (``mori_core._C.io_profile``); Python's ``time.perf_counter_ns`` reads
the same clock, so the benchmark's own stamps before and after the call sit on
the same time line:

  t0 ──call──> enter ──read args──> converted ──validate──> validated
     ──backend (incl. GPU launch API)──> submitted ──return──> t1 ──wait──> t2
"""

from __future__ import annotations

import time
from typing import Callable

from mori_core import _C
from mori_core.bench.table import median
from mori_core.io import StatusCode

PIECES = ("to C++", "read args", "validate", "backend", "of which launch", "return", "host total", "completion",
          "latency")


def breakdown(submit: Callable[[int], object], uid: Callable[[], int], iters: int, warmup: int) -> dict[str, float]:
    """Median microseconds of each piece of ``submit(uid)`` (a transfer call returning one status)."""
    pc = time.perf_counter_ns
    rows = []
    _C.io_profile(True)
    try:
        for i in range(warmup + iters):
            u = uid()
            t0 = pc()
            st = submit(u)
            t1 = pc()
            p = _C.io_profile_last()
            code = st.WaitFor(60_000)
            t2 = pc()
            if code != StatusCode.SUCCESS:
                raise RuntimeError(f"transfer failed: {code} {st.Message()}")
            if i < warmup:
                continue
            launch = p["launch_end"] - p["launch_begin"] if p["launch_begin"] else 0
            rows.append((p["enter"] - t0, p["converted"] - p["enter"], p["validated"] - p["converted"],
                         p["submitted"] - p["validated"], launch, t1 - p["submitted"], t1 - t0, t2 - t1, t2 - t0))
    finally:
        _C.io_profile(False)
    if rows and min(r[0] for r in rows) < 0:
        raise RuntimeError("core timestamps are not on time.perf_counter_ns' clock on this platform")
    return {name: median([r[k] for r in rows]) / 1e3 for k, name in enumerate(PIECES)}
