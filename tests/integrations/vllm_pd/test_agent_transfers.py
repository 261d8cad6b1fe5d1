"""The connector's worker side moving vLLM-layout KV between processes (CPU, TCP backend).

Each "worker" is a :class:`agent_host.AgentProcess`: a real ``TransferAgent`` (IO
engine, control plane, producer/consumer state machines) in its own process, with KV
views laid out like vLLM's. Only vLLM is faked: the test plays its scheduler, handing
out block ids, send jobs and receive jobs. Bytes are compared head by head.
"""

from __future__ import annotations

import itertools
import time
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from mori_core.bench.pd_agents import AgentProcess, free_port_block, layer_names  # noqa: E402
from mori_integrations.vllm.kv_connector.metadata import FinishedSend, PeerAddress, RecvJob, SendJob  # noqa: E402
from mori_integrations.vllm.kv_connector.tp_mapping import heads_of_rank, source_rank  # noqa: E402

LAYERS, BLOCKS, TOKENS, CONTENT, TOTAL_HEADS = 2, 64, 16, 32, 2
TIMEOUTS = {"transfer_timeout": 10, "recv_abort_timeout": 30, "defer_timeout": 60, "handshake_timeout": 5}
_ids = itertools.count()


def _spec(engine_id: str, tp_rank: int, tp_size: int, base: Tuple[int, int], **over) -> Dict:
    extra = {"backend": "tcp", "host_ip": "127.0.0.1", "handshake_port": base[0], "notify_port": base[1], **TIMEOUTS}
    extra.update(over.pop("extra", {}))
    spec = dict(engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size, total_heads=TOTAL_HEADS, layers=LAYERS,
                num_blocks=BLOCKS, heads=max(1, TOTAL_HEADS // tp_size), tokens=TOKENS, content=CONTENT, extra=extra)
    spec.update(over)
    return spec


class Server:
    """The workers of one fake vLLM server (one agent per TP rank)."""

    def __init__(self, name: str, tp: int, **over) -> None:
        self.name, self.tp = name, tp
        self.base = (free_port_block(tp), free_port_block(tp))
        self.ranks = [AgentProcess(_spec(name, r, tp, self.base, **over)) for r in range(tp)]

    @property
    def address(self) -> PeerAddress:
        return PeerAddress("127.0.0.1", self.base[0], self.base[1], 0, self.tp)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[Dict[str, Server]]:
    made: Dict[str, Server] = {}
    try:
        made["P"] = Server("prefill-tp1", 1)
        made["P"].ranks[0].call("fill", 1)
        made["P2"] = Server("prefill-tp2", 2)
        for i, r in enumerate(made["P2"].ranks):
            r.call("fill", 10 + i)
        made["D"] = Server("decode-tp1", 1, layout="LBNHC")  # another layout than the prefills'
        made["D2"] = Server("decode-tp2", 2)
        yield made
    finally:
        for s in made.values():
            s.close()


_free: Dict[str, Iterator[int]] = {}


def _blocks(server: Server, n: int) -> List[int]:
    """Fresh, scattered block ids of ``server`` (never handed out before in this module; 0 is vLLM's null block)."""
    order = np.random.default_rng(len(server.name)).permutation(np.arange(1, BLOCKS)).tolist()
    it = _free.setdefault(server.name, iter(order))
    return [next(it) for _ in range(n)]


def _check_moved(src: Server, dst: Server, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
    """Every destination head of every listed block equals the source head it comes from."""
    for layer in layer_names(LAYERS):
        got = [r.call("read", (layer, list(dst_blocks))) for r in dst.ranks]
        want = [r.call("read", (layer, list(src_blocks))) for r in src.ranks]
        for d_rank in range(dst.tp):
            for d_local, head in enumerate(heads_of_rank(TOTAL_HEADS, dst.tp, d_rank)):
                p_rank = source_rank(TOTAL_HEADS, src.tp, head, d_rank)
                p_local = heads_of_rank(TOTAL_HEADS, src.tp, p_rank).index(head)
                a, b = got[d_rank][:, d_local], want[p_rank][:, p_local]
                assert a.shape == b.shape, (layer, head, a.shape, b.shape)
                if not np.array_equal(a, b):
                    bad = np.argwhere(a != b)[0]
                    raise AssertionError(
                        f"{layer} head {head} (decode rank {d_rank} local {d_local} <- prefill rank {p_rank} "
                        f"local {p_local}): first mismatch at [block {bad[0]}, token {bad[1]}, elem {bad[2]}]: "
                        f"{a[tuple(bad)]} != {b[tuple(bad)]}"
                    )


def _zero(server: Server, blocks: Sequence[int]) -> bool:
    return all(not np.any(r.call("read", (layer, list(blocks)))) for r in server.ranks for layer in layer_names(LAYERS))


def _results(server: Server, timeout: float = 60) -> List:
    out = [r.call("results", (1, timeout), timeout=timeout + 30) for r in server.ranks]
    assert all(len(o) == 1 for o in out), out
    return [o[0] for o in out]


def _transfer(src: Server, dst: Server, mode: str, n: int = 5, skip: int = 0, pipelined_race: bool = False):
    """One request: src computes ``n`` blocks, dst keeps ``skip`` of them from its prefix cache."""
    tid = f"t{next(_ids)}-{mode}"
    src_blocks, dst_blocks = _blocks(src, n), _blocks(dst, n)
    tokens = n * TOKENS - 3  # last block partly filled
    job = RecvJob(req_id=f"d-{tid}", transfer_id=tid, mode=mode, peer=src.address, local_block_ids=[dst_blocks],
                  positions=[skip], num_prompt_tokens=tokens,
                  remote_block_ids=[src_blocks] if mode == "read" else None)
    send = SendJob(req_id=f"p-{tid}", transfer_id=tid, block_ids=[src_blocks], num_prompt_tokens=tokens)
    if mode == "write" and pipelined_race:
        for r in dst.ranks:
            r.call("recv", job)
        deadline = time.monotonic() + 30  # let every write request reach the prefill before its "forward"
        while not all(r.call("pending")[0] for r in src.ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        for r in src.ranks:
            r.call("send", (send, True))
    else:
        for r in src.ranks:
            r.call("send", (send, False))
        for r in dst.ranks:
            r.call("recv", job)
    results = _results(dst)
    for r in src.ranks:
        r.call("finish", FinishedSend(req_id=send.req_id, transfer_id=tid, aborted=False))
    released = [r.call("take_finished", 30, timeout=60) for r in src.ranks]
    return results, released, src_blocks, dst_blocks, send.req_id


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("pair", ["P>D", "P2>D", "P>D2"])
def test_kv_moves_between_tp_sizes_and_layouts(servers, mode: str, pair: str) -> None:
    src, dst = (servers[k] for k in pair.split(">"))
    before = [r.call("totals")["bytes_received"] for r in dst.ranks]
    results, released, sb, db, req = _transfer(src, dst, mode, n=5, skip=1, pipelined_race=(mode == "write"))
    assert all(r.ok for r in results), results
    assert released == [[req]] * src.tp, "the prefill must release the request once every decode rank is done"
    _check_moved(src, dst, sb[1:], db[1:])
    assert _zero(dst, db[:1]), "the decode's own prefix-cache block was overwritten"
    per_head_block = LAYERS * TOKENS * CONTENT * 4  # one head of one block over all layers
    moved = [r.call("totals")["bytes_received"] - b for r, b in zip(dst.ranks, before)]
    heads_per_rank = len(heads_of_rank(TOTAL_HEADS, dst.tp, 0))
    assert moved == [4 * heads_per_rank * per_head_block] * dst.tp
    assert sum(r.nbytes for r in results) == sum(moved)


def test_write_request_after_the_kv_was_computed(servers) -> None:
    results, released, sb, db, req = _transfer(servers["P"], servers["D"], "write", n=3, skip=0, pipelined_race=False)
    assert all(r.ok for r in results), results
    _check_moved(servers["P"], servers["D"], sb, db)
    assert released == [[req]]
