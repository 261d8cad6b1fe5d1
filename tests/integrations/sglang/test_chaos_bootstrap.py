"""CI's fuzz of the SGLang PD bootstrap server (the chaos harness's short profile, sglang part).

2,000 malformed HTTP inputs (mutated requests, random bytes, invalid UTF-8,
truncated requests, resets), each round followed by a legitimate PUT /route and
GET /health; fails on a crash, a failed legitimate request, or descriptor/RSS
growth beyond the harness's bounds. Then the attacks of issue #29: a flood of 2,000 bad
inputs (no 5xx, no traceback, at most 100 log lines; main: 7,868 lines, 429 tracebacks and
323 HTTP 500s for 600) and 100 forged or replayed ``PUT /route`` against two servers that
share a secret (0 accepted; main accepted all).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from mori_core.bench.chaos import run_adapter_attacks, run_fuzz  # noqa: E402

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def test_fuzz_bootstrap_server() -> None:
    failures = run_fuzz(["sglang"], 2000, 8, 64.0, require_installed=True)
    assert not failures, failures


def test_bootstrap_flood_and_forgery() -> None:
    failures = run_adapter_attacks(["bootstrap-flood", "bootstrap-forgery"], 2000, require_installed=True)
    assert not failures, failures
