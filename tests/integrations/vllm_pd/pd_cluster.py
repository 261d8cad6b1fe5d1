"""Fake vLLM servers made of real connector agents (one process per TP rank), for the agent tests.

The test plays vLLM's scheduler: it hands out block ids, send jobs and receive jobs;
everything below (engines, control plane, state machines) is the connector's own.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from mori_core.bench.pd_agents import AgentProcess, free_port_block, layer_names
from mori_integrations.vllm.kv_connector.metadata import FinishedSend, PeerAddress, RecvJob, SendJob
from mori_integrations.vllm.kv_connector.tp_mapping import heads_of_rank, source_rank

TIMEOUTS = {"transfer_timeout": 10, "recv_abort_timeout": 30, "defer_timeout": 60, "handshake_timeout": 5}
_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Shape:
    """KV cache shape shared by every server of a test (per layer: blocks x heads x tokens x content)."""

    layers: int = 2
    blocks: int = 64
    tokens: int = 16
    content: int = 32
    total_heads: int = 2
    dtype: str = "float32"

    @property
    def head_block_bytes(self) -> int:
        """One head of one block over all layers."""
        elem = 2 if self.dtype in ("bfloat16", "float16") else 4
        return self.layers * self.tokens * self.content * elem


class Server:
    """The workers of one fake vLLM server; rank ``r`` runs on ``devices[r]``."""

    def __init__(self, name: str, tp: int, shape: Shape = Shape(), devices: Optional[Sequence[str]] = None,
                 layout: str = "LBHNC", extra: Optional[Dict] = None, ports: Optional[Tuple[int, int]] = None,
                 submit_inline: bool = False, record_threads: bool = False, drop_write_done: bool = False) -> None:
        """``ports``: (handshake, notify) base ports, e.g. a dead server's to start in its place.
        ``submit_inline``: the agents take every route for XGMI's; ``record_threads``: they record
        which threads wrote or read KV (the ``submit_threads`` command; see ``pd_agents._serve``);
        ``drop_write_done``: they ignore WriteDone messages (only doorbells can finish a WRITE)."""
        self.name, self.tp, self.shape = name, tp, shape
        self.base = ports or (free_port_block(tp), free_port_block(tp))
        cfg = {"backend": "tcp", "host_ip": "127.0.0.1", "handshake_port": self.base[0],
               "notify_port": self.base[1], **TIMEOUTS, **(extra or {})}
        devices = list(devices or ["cpu"] * tp)
        self.instance = uuid.uuid4().hex  # what vLLM's scheduler of this server would hand its workers
        self.ranks: List[AgentProcess] = []
        try:
            for r in range(tp):
                self.ranks.append(AgentProcess(dict(
                    engine_id=name, tp_rank=r, tp_size=tp, total_heads=shape.total_heads, layers=shape.layers,
                    num_blocks=shape.blocks, heads=max(1, shape.total_heads // tp), tokens=shape.tokens,
                    content=shape.content, dtype=shape.dtype, layout=layout, device=devices[r], extra=cfg,
                    instance_id=self.instance, submit_inline=submit_inline, record_submit_threads=record_threads,
                    drop_write_done=drop_write_done)))
        except BaseException:
            self.close()
            raise
        rng = np.random.default_rng(len(name))
        self._free: Iterator[int] = iter(rng.permutation(np.arange(1, shape.blocks)).tolist())  # 0: vLLM's null block

    @property
    def address(self) -> PeerAddress:
        return PeerAddress("127.0.0.1", self.base[0], self.base[1], 0, self.tp)

    def blocks(self, n: int) -> List[int]:
        """Fresh, scattered block ids (never handed out before by this server)."""
        return [next(self._free) for _ in range(n)]

    def results(self, timeout: float = 60) -> List:
        out = [r.call("results", (1, timeout), timeout=timeout + 30) for r in self.ranks]
        assert all(len(o) == 1 for o in out), out
        return [o[0] for o in out]

    def zero(self, blocks: Sequence[int]) -> bool:
        return all(not np.any(r.call("read", (layer, list(blocks))))
                   for r in self.ranks for layer in layer_names(self.shape.layers))

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def check_moved(src: Server, dst: Server, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
    """Every destination head of every listed block equals the source head it comes from."""
    total = src.shape.total_heads
    for layer in layer_names(src.shape.layers):
        got = [r.call("read", (layer, list(dst_blocks))) for r in dst.ranks]
        want = [r.call("read", (layer, list(src_blocks))) for r in src.ranks]
        for d_rank in range(dst.tp):
            for d_local, head in enumerate(heads_of_rank(total, dst.tp, d_rank)):
                p_rank = source_rank(total, src.tp, head, d_rank)
                p_local = heads_of_rank(total, src.tp, p_rank).index(head)
                a, b = got[d_rank][:, d_local], want[p_rank][:, p_local]
                assert a.shape == b.shape, (layer, head, a.shape, b.shape)
                if not np.array_equal(a, b):
                    bad = np.argwhere(a != b)[0]
                    raise AssertionError(
                        f"{layer} head {head} (decode rank {d_rank} local {d_local} <- prefill rank {p_rank} "
                        f"local {p_local}): {int((a != b).sum())} of {a.size} values differ, first at "
                        f"[block {bad[0]}, token {bad[1]}, elem {bad[2]}]: {a[tuple(bad)]} != {b[tuple(bad)]}"
                    )


def transfer(src: Server, dst: Server, mode: str, n: int = 5, skip: int = 0, pipelined_race: bool = False
             ) -> Tuple[List, List, List[int], List[int], str]:
    """One request: ``src`` computes ``n`` blocks, ``dst`` keeps ``skip`` of them from its prefix cache.

    With ``pipelined_race`` (WRITE), every decode rank's write request reaches the prefill
    before its "forward", so the layer-by-layer path runs. Returns (decode results,
    per-prefill-rank released request ids, src blocks, dst blocks, prefill request id).
    """
    tid = f"t{next(_ids)}-{mode}"
    src_blocks, dst_blocks = src.blocks(n), dst.blocks(n)
    tokens = n * src.shape.tokens - 3  # last block partly filled
    job = RecvJob(req_id=f"d-{tid}", transfer_id=tid, mode=mode, peer=src.address, local_block_ids=[dst_blocks],
                  positions=[skip], num_prompt_tokens=tokens,
                  remote_block_ids=[src_blocks] if mode == "read" else None,
                  remote_instance_id=src.instance if mode == "read" else None)
    send = SendJob(req_id=f"p-{tid}", transfer_id=tid, block_ids=[src_blocks], num_prompt_tokens=tokens)
    if mode == "write" and pipelined_race:
        for r in dst.ranks:
            r.call("recv", job)
        deadline = time.monotonic() + 30
        while not all(r.call("pending")[0] for r in src.ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        for r in src.ranks:
            r.call("send", (send, True))
    else:
        for r in src.ranks:
            r.call("send", (send, False))
        for r in dst.ranks:
            r.call("recv", job)
    results = dst.results()
    for r in src.ranks:
        r.call("finish", FinishedSend(req_id=send.req_id, transfer_id=tid, aborted=False))
    released = [r.call("take_finished", 30, timeout=60) for r in src.ranks]
    return results, released, src_blocks, dst_blocks, send.req_id
