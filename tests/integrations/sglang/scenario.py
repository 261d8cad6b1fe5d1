"""Drive one request through real prefill/decode managers in separate processes, and check bytes."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Dict, List, Optional

import numpy as np

from pd_cluster import Host

# KVPoll values (sglang.srt.disaggregation.base.conn.KVPoll)
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4

_counter = itertools.count()


def layout(*, mla: bool, page_size: int, state: tuple = ()) -> dict:
    return {
        "mla": mla,
        "page_size": page_size,
        "num_pages": 64,
        "layers": 3,
        "total_heads": 4,
        "head_dim": 8,
        "mla_dim": 24,
        "state": list(state),
    }


@dataclasses.dataclass
class Deployment:
    """A bootstrap server plus prefill and decode managers of one configuration."""

    hosts: Dict[str, Host]
    layout: dict
    ptp: int
    dtp: int
    name: str
    addr: str
    written: set = dataclasses.field(default_factory=set)  # decode pages of earlier requests

    @property
    def prefill(self) -> List[Host]:
        return [self.hosts[f"P{r}"] for r in range(self.ptp)]

    @property
    def decode(self) -> List[Host]:
        return [self.hosts[f"D{r}"] for r in range(self.dtp)]

    def teardown(self) -> None:
        for h in self.prefill + self.decode:
            h.call("teardown", name=self.name)


def deploy(hosts: Dict[str, Host], lay: dict, ptp: int, dtp: int) -> Deployment:
    name = f"m{next(_counter)}"
    port = hosts["B"].call("bootstrap", name=name)
    for r in range(ptp):
        hosts[f"P{r}"].call("manager", name=name, role="prefill", tp_size=ptp, tp_rank=r, bootstrap_port=port, layout=lay, seed=1000 + r)
    for r in range(dtp):
        hosts[f"D{r}"].call("manager", name=name, role="decode", tp_size=dtp, tp_rank=r, bootstrap_port=port, layout=lay, seed=0)
    return Deployment(hosts, lay, ptp, dtp, name, f"127.0.0.1:{port}")


@dataclasses.dataclass
class Request:
    room: int
    src_pages: List[int]
    dst_pages: List[int]
    src_aux: int
    dst_aux: int
    src_state: Optional[List[List[int]]]
    dst_state: Optional[List[List[int]]]


def new_request(dep: Deployment, num_pages: int = 11, seed: int = 0) -> Request:
    rng = random.Random(seed)
    lay = dep.layout
    # Non-contiguous and unequal on both sides, so page mapping errors show.
    src = rng.sample(range(1, lay["num_pages"]), num_pages)
    dst = sorted(rng.sample(range(1, lay["num_pages"]), num_pages))
    src_state = dst_state = None
    if lay["state"]:
        src_state, dst_state = [], []
        for comp in lay["state"]:
            if comp == "mamba":
                src_state.append([rng.randrange(8)])
                dst_state.append([rng.randrange(8)])
            else:  # swa window: the last pages of the request, in the SWA pool
                src_state.append(rng.sample(range(lay["num_pages"]), 3))
                dst_state.append(rng.sample(range(lay["num_pages"]), 3))
    return Request(rng.getrandbits(62), src, dst, rng.randrange(8), rng.randrange(8), src_state, dst_state)


def bootstrap_request(dep: Deployment, req: Request) -> None:
    """Senders on every prefill rank, receivers with metadata on every decode rank."""
    for p in dep.prefill:
        assert p.call("sender", name=dep.name, room=req.room, addr=dep.addr) in (BOOTSTRAPPING, WAITING)
    for d in dep.decode:
        d.call("receiver", name=dep.name, room=req.room, addr=dep.addr)
        d.call(
            "receiver_send_metadata", name=dep.name, room=req.room, pages=req.dst_pages, aux_index=req.dst_aux, state=req.dst_state
        )
    for p in dep.prefill:
        got = p.call("wait", side="sender", name=dep.name, room=req.room, until=[WAITING, FAILED], within=20)
        assert got["status"] == WAITING, f"prefill sender never got decode metadata: {got}"
        p.call("sender_init", name=dep.name, room=req.room, num_pages=len(req.src_pages), aux_index=req.src_aux)


def send_chunks(host: Host, dep: Deployment, req: Request, split: int) -> None:
    host.call("sender_send", name=dep.name, room=req.room, pages=req.src_pages[:split])
    host.call("sender_send", name=dep.name, room=req.room, pages=req.src_pages[split:], state=req.src_state)


def wait_status(host: Host, side: str, dep: Deployment, req: Request, until: List[int], timeout: float = 30) -> dict:
    return host.call("wait", side=side, name=dep.name, room=req.room, until=until, within=timeout, timeout=timeout + 30)


def expected_decode_kv(dep: Deployment, req: Request, d_rank: int) -> List[np.ndarray]:
    """What decode rank ``d_rank`` must hold at ``dst_pages``, built from the prefill ranks' bytes."""
    lay = dep.layout
    prefill_pages = [p.call("read_kv", name=dep.name, pages=req.src_pages) for p in dep.prefill]
    if lay["mla"]:
        # Latent KV is whole on every rank; the real (non-dummy) source is prefill rank
        # d_rank * ptp / dtp (SGLang's mapping), which for these sizes is 0 or d_rank-derived.
        src_rank = (d_rank * dep.ptp) // dep.dtp if dep.ptp > dep.dtp else d_rank // (dep.dtp // dep.ptp)
        return prefill_pages[src_rank]
    ps, heads, hd = lay["page_size"], lay["total_heads"], lay["head_dim"] * 2  # bf16 bytes
    out = []
    for e in range(len(prefill_pages[0])):
        full = np.concatenate(
            [pp[e].reshape(len(req.src_pages), ps, heads // dep.ptp, hd) for pp in prefill_pages], axis=2
        )
        per = heads // dep.dtp
        out.append(full[:, :, d_rank * per : (d_rank + 1) * per, :].reshape(len(req.src_pages), -1))
    return out


def check_kv(dep: Deployment, req: Request) -> None:
    dep.written |= set(req.dst_pages)
    untouched = sorted(set(range(dep.layout["num_pages"])) - dep.written)
    for d_rank, d in enumerate(dep.decode):
        got = d.call("read_kv", name=dep.name, pages=req.dst_pages)
        want = expected_decode_kv(dep, req, d_rank)
        for e, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), f"decode rank {d_rank}, KV entry {e}: bytes differ"
        for e, g in enumerate(d.call("read_kv", name=dep.name, pages=untouched)):
            assert not g.any(), f"decode rank {d_rank}, KV entry {e}: a page outside the request was written"


def check_aux(dep: Deployment, req: Request) -> None:
    want = dep.prefill[0].call("read_aux", name=dep.name, row=req.src_aux)
    for d in dep.decode:
        assert d.call("read_aux", name=dep.name, row=req.dst_aux) == want
        other = (req.dst_aux + 1) % 8
        assert not any(any(b) for b in d.call("read_aux", name=dep.name, row=other))


def check_state(dep: Deployment, req: Request) -> None:
    ps = dep.layout["page_size"]
    for c, comp in enumerate(dep.layout["state"]):
        page = 1 if comp == "mamba" else ps
        want = dep.prefill[0].call("read_state", name=dep.name, comp=c, rows=req.src_state[c], page_size=page)
        got = dep.decode[0].call("read_state", name=dep.name, comp=c, rows=req.dst_state[c], page_size=page)
        for e, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), f"state component {comp}, tensor {e}: bytes differ"


def run_request(dep: Deployment, req: Request) -> None:
    """Full request; the highest prefill rank sends first and decode must not finish early."""
    bootstrap_request(dep, req)
    split = max(1, len(req.src_pages) // 2)
    ranks = list(enumerate(dep.prefill))[::-1]
    for r, p in ranks[:-1]:
        send_chunks(p, dep, req, split)
        got = wait_status(p, "sender", dep, req, [SUCCESS, FAILED])
        assert got["status"] == SUCCESS, p.call("failure", side="sender", name=dep.name, room=req.room)
    if len(ranks) > 1:
        # Prefill rank 0 has not sent: no decode rank may report Success yet (for MLA,
        # rank 1 is a dummy rank and must never report it; for MHA its heads are missing).
        time.sleep(0.5)
        for d in dep.decode:
            assert d.call("poll", side="receiver", name=dep.name, room=req.room) != SUCCESS
    send_chunks(ranks[-1][1], dep, req, split)
    for p in dep.prefill:
        got = wait_status(p, "sender", dep, req, [SUCCESS, FAILED])
        assert got["status"] == SUCCESS, p.call("failure", side="sender", name=dep.name, room=req.room)
    for d in dep.decode:
        got = wait_status(d, "receiver", dep, req, [SUCCESS, FAILED])
        assert got["status"] == SUCCESS, d.call("failure", side="receiver", name=dep.name, room=req.room)
    check_kv(dep, req)
    check_aux(dep, req)
    if req.src_state is not None:
        check_state(dep, req)
    for p in dep.prefill:
        p.call("clear", side="sender", name=dep.name, room=req.room)
    for d in dep.decode:
        d.call("clear", side="receiver", name=dep.name, room=req.room)
