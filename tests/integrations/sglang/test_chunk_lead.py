"""The SGLang prefill's chunk data path submitting a large chunk in two calls (lead region pairs first).

Two processes with SGLang-shaped pools in host memory (``mori_core.bench.sglang_agents``, the same
harness as the GPU test), the real engines over TCP. A chunk of >= 32 MiB over 16 K/V buffers goes
in two ``batch_write`` calls (4 lead pairs, then the rest with the metadata row); a small chunk in
one. Bytes are compared page by page either way.
"""

from __future__ import annotations

import concurrent.futures
from typing import Dict, Iterator

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from mori_core.bench.sglang_agents import SglangRank  # noqa: E402
from mori_integrations.common.segments import LEAD_MIN_BYTES  # noqa: E402

SHAPE = dict(layers=8, heads=8, head_dim=128, page_size=16, num_pages=80, aux_rows=4, dtype="bfloat16",
             timeout_s=30.0, device="cpu", tp_size=1, tp_rank=0)
PAGE_BYTES = 16 * 8 * 128 * 2  # one page of one K or V buffer


@pytest.fixture(scope="module")
def ranks() -> Iterator[Dict[str, SglangRank]]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(SglangRank, "prefill", dict(SHAPE, seed=4))
        d = pool.submit(SglangRank, "decode", dict(SHAPE))
    made = {"P": p.result(), "D": d.result()}
    made["P"].call("connect", (made["D"].call("registration"), None))
    yield made
    for r in made.values():
        r.close()


def _pages(rank: SglangRank, pages) -> np.ndarray:
    return rank.call("pages", list(pages))


@pytest.mark.parametrize("n_pages, lead", [(72, 4), (4, 0)])
def test_a_large_chunk_goes_in_two_calls(ranks, n_pages: int, lead: int) -> None:
    p, d = ranks["P"], ranks["D"]
    rng = np.random.default_rng(n_pages)
    src = (rng.permutation(79) + 1)[:n_pages].tolist()
    dst = (rng.permutation(79) + 1)[:n_pages].tolist()
    assert (n_pages * 2 * SHAPE["layers"] * PAGE_BYTES >= LEAD_MIN_BYTES) == (lead > 0)
    room = 40 + n_pages
    p.call("target", d.call("metadata", (room, dst, 1, 1)))
    res = p.call("write", (room, src, 0, n_pages, True, 2))
    assert res["failure"] is None and res["quiescent"], res
    assert res["lead"] == lead, res
    assert np.array_equal(_pages(d, dst), _pages(p, src)), "KV bytes differ"
    assert d.call("aux_rows", 1) == p.call("aux_rows", 2), "the metadata row (in the rest's call) differs"
