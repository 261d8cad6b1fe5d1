"""SGLang PD's prefill -> decode KV and metadata transfer between GPUs, below SGLang's interface.

The GPU machine has no SGLang, so SGLang's part is played here (``mori_core.bench.sglang_agents``):
each rank is a process with SGLang-shaped pools (one ``[pages * 16, heads, 128]`` bf16 tensor
per layer for K and one for V; host metadata buffers) registered with its engine. The decode
rank produces its ``PeerRegistration`` and the request's ``TransferMetadata`` with the
adapter's codec; the prefill rank takes them as ``MoriKVManager`` does and runs the adapter's
chunk data path (``PrefillTransferMixin._write_chunk``: plan, one ``batch_write``, bounded
wait) for each chunk. KV goes over XGMI (asserted), the metadata row (host memory) over TCP.
Bytes are compared page by page; pages the request does not own stay untouched.
"""

from __future__ import annotations

import concurrent.futures
from typing import Dict, List

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from mori_core.bench.sglang_agents import AUX_ITEM_BYTES, SglangRank  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

SHAPE = dict(layers=4, head_dim=128, page_size=16, num_pages=64, aux_rows=4, dtype="bfloat16", timeout_s=20.0)


def _start(specs: Dict[str, tuple]) -> Dict[str, SglangRank]:
    """Start ranks concurrently: name -> (role, spec)."""
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futures = {n: pool.submit(SglangRank, role, dict(SHAPE, **spec)) for n, (role, spec) in specs.items()}
    made, error = {}, None
    for name, f in futures.items():
        try:
            made[name] = f.result()
        except Exception as e:
            error = error or e
    if error is not None:
        for r in made.values():
            r.close()
        raise error
    return made


def _pages(rank: SglangRank, pages: List[int]) -> np.ndarray:
    """[buffers, pages, page_size, heads, head_dim * 2 bytes]."""
    spec = rank.spec
    raw = rank.call("pages", list(pages))
    return raw.reshape(raw.shape[0], len(pages), spec["page_size"], spec["heads"], -1)


@pytest.fixture(scope="module")
def two() -> Dict[str, SglangRank]:
    ranks = _start({"P": ("prefill", dict(heads=8, device="cuda:0", tp_size=1, tp_rank=0, seed=5)),
                    "D": ("decode", dict(heads=8, device="cuda:1", tp_size=1, tp_rank=0))})
    yield ranks
    for r in ranks.values():
        r.close()


def test_chunks_move_kv_over_xgmi_and_metadata_with_the_last(two) -> None:
    p, d = two["P"], two["D"]
    p.call("connect", (d.call("registration"), None))
    rng = np.random.default_rng(1)
    src = (rng.permutation(63) + 1)[:40].tolist()  # scattered pages, page 0 left alone
    dst = (rng.permutation(63) + 1)[:40].tolist()
    room = 17
    p.call("target", d.call("metadata", (room, dst, 1, 1)))
    first = p.call("write", (room, src[:24], 0, 24, False, None))
    last = p.call("write", (room, src[24:], 24, 40, True, 2))
    assert first["failure"] is None and last["failure"] is None, (first, last)
    assert first["quiescent"] and last["quiescent"]
    page_bytes = SHAPE["page_size"] * 8 * SHAPE["head_dim"] * 2
    assert last["bytes_sent"] == 40 * 2 * SHAPE["layers"] * page_bytes + sum(AUX_ITEM_BYTES)
    routes = p.call("routes")
    assert {v for k, v in routes.items() if k.endswith("kv")} == {"XGMI"}, routes
    assert {v for k, v in routes.items() if k.endswith("aux")} == {"TCP"}, routes  # host memory
    got, want = _pages(d, dst), _pages(p, src)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} bytes differ, first at [buffer, page, token, head, byte] {bad[0].tolist()}"
    assert d.call("aux_rows", 1) == p.call("aux_rows", 2)
    untouched = sorted(set(range(64)) - set(dst))
    assert not _pages(d, untouched).any(), "pages outside the request were written"
    assert not any(any(b) for b in d.call("aux_rows", 0)), "another metadata row was written"


def test_a_large_chunk_goes_in_two_calls_over_xgmi() -> None:
    """A 40 MiB chunk over 16 K/V buffers: its lead region pairs go in a call of their own
    (``_submit_chunk``), the rest with the metadata row in a second; bytes compared page by page."""
    ranks = _start({"P": ("prefill", dict(heads=8, device="cuda:0", tp_size=1, tp_rank=0, seed=9, layers=8,
                                          num_pages=96)),
                    "D": ("decode", dict(heads=8, device="cuda:1", tp_size=1, tp_rank=0, layers=8, num_pages=96))})
    try:
        p, d = ranks["P"], ranks["D"]
        p.call("connect", (d.call("registration"), None))
        rng = np.random.default_rng(4)
        src = (rng.permutation(95) + 1)[:80].tolist()
        dst = (rng.permutation(95) + 1)[:80].tolist()
        p.call("target", d.call("metadata", (31, dst, 1, 1)))
        res = p.call("write", (31, src, 0, 80, True, 3))
        assert res["failure"] is None and res["quiescent"], res
        assert res["lead"] == 4, res  # 16 K/V pairs + the metadata row's: a quarter of 17
        assert np.array_equal(_pages(d, dst), _pages(p, src)), "KV bytes differ"
        assert d.call("aux_rows", 1) == p.call("aux_rows", 3)
        assert {v for k, v in p.call("routes").items() if k.endswith("kv")} == {"XGMI"}
    finally:
        for r in ranks.values():
            r.close()


def test_tp2_prefill_to_tp2_and_tp1_decode_four_gpus() -> None:
    """Prefill TP2 (GPUs 0, 1) -> decode TP2 (GPUs 2, 3): rank r writes rank r, 4 heads each; and
    the same prefill -> a TP1 decode (GPU 3), each prefill rank writing its 4 heads into the
    decode's 8 (the head slice SGLang's compute_head_slice_params gives for 2 -> 1)."""
    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 GPUs, {torch.cuda.device_count()} visible")
    ranks = _start({
        "P0": ("prefill", dict(heads=4, device="cuda:0", tp_size=2, tp_rank=0, seed=10)),
        "P1": ("prefill", dict(heads=4, device="cuda:1", tp_size=2, tp_rank=1, seed=11)),
        "D0": ("decode", dict(heads=4, device="cuda:2", tp_size=2, tp_rank=0)),
        "D1": ("decode", dict(heads=4, device="cuda:3", tp_size=2, tp_rank=1)),
        "T": ("decode", dict(heads=8, device="cuda:3", tp_size=1, tp_rank=0)),
    })
    try:
        rng = np.random.default_rng(2)
        src = (rng.permutation(63) + 1)[:32].tolist()
        dst = (rng.permutation(63) + 1)[:32].tolist()
        for r in (0, 1):
            p, d = ranks[f"P{r}"], ranks[f"D{r}"]
            p.call("connect", (d.call("registration"), None))
            p.call("target", d.call("metadata", (100, dst, -1, 1)))
            res = p.call("write", (100, src, 0, 32, True, None))
            assert res["failure"] is None, res
            assert np.array_equal(_pages(d, dst), _pages(p, src)), f"TP2 -> TP2 rank {r}"
        t = ranks["T"]
        for r in (0, 1):
            p = ranks[f"P{r}"]
            p.call("connect", (t.call("registration"),
                               dict(src_heads=4, dst_heads=8, src_head_start=0, dst_head_start=4 * r, num_heads=4)))
            p.call("target", t.call("metadata", (200, dst, -1, 2)))
        for r in (0, 1):
            res = ranks[f"P{r}"].call("write", (200, src, 0, 32, True, None))
            assert res["failure"] is None, res
        got = _pages(t, dst)
        for r in (0, 1):
            want = _pages(ranks[f"P{r}"], src)
            assert np.array_equal(got[:, :, :, 4 * r:4 * r + 4], want), f"TP2 -> TP1 heads of prefill rank {r}"
        assert {v for k, v in ranks["P0"].call("routes").items() if k.endswith("kv")} == {"XGMI"}
    finally:
        for r in ranks.values():
            r.close()
