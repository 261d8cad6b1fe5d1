"""CI's run of the chaos harness's short profile (``python -m mori_core.bench chaos --profile short``).

Fails on any crash, hang (every step is bounded), lost or corrupt byte, failed
legitimate transfer after fuzzing, descriptor growth above 8 or RSS growth above
64 MiB per listener, and a killed or stopped peer noticed later than 2 s. The
SGLang bootstrap server is fuzzed and attacked by tests/integrations/sglang/test_chaos_bootstrap.py
(its environment has sglang). The ``stale-kv`` attack (issue #29: a prefill restarted with a
fixed engine id, its predecessor's params replayed) must be refused within 2 s with nothing
loaded. Timings are printed, never asserted otherwise.
"""

from __future__ import annotations

import pytest

from mori_core.bench.chaos import run_adapter_attacks, run_faults, run_fuzz, run_load_section

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

MAX_FD_GROWTH = 8
MAX_RSS_GROWTH_MB = 64.0
MAX_DETECT_S = 2.0


@pytest.mark.parametrize("listener", ["io", "pd", "omni"])
def test_fuzz_listener(listener: str) -> None:
    failures = run_fuzz([listener], 2000, MAX_FD_GROWTH, MAX_RSS_GROWTH_MB, require_installed=True)
    assert not failures, failures


def test_faults() -> None:
    failures = run_faults(["kill", "stall", "reset", "deregister"], MAX_DETECT_S)
    assert not failures, failures


def test_load_30s() -> None:
    failures = run_load_section(pairs=8, seconds=30.0)
    assert not failures, failures


def test_adapter_attack_stale_kv_params_after_a_restart() -> None:
    failures = run_adapter_attacks(["stale-kv"], 0, require_installed=True)
    assert not failures, failures
