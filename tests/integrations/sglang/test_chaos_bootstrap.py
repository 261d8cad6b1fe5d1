"""CI's fuzz of the SGLang PD bootstrap server (the chaos harness's short profile, sglang part).

2,000 malformed HTTP inputs (mutated requests, random bytes, invalid UTF-8,
truncated requests, resets), each round followed by a legitimate PUT /route and
GET /health; fails on a crash, a failed legitimate request, or descriptor/RSS
growth beyond the harness's bounds.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from mori_core.bench.chaos import run_fuzz  # noqa: E402

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def test_fuzz_bootstrap_server() -> None:
    failures = run_fuzz(["sglang"], 2000, 8, 64.0, require_installed=True)
    assert not failures, failures
