"""Chaos attack ``stale-kv``: a vLLM prefill restarted on the same ports with a fixed engine id,
then its predecessor's ``kv_transfer_params`` replayed to the decode (issue #29 item 7).

Real connector agents in three processes (vLLM's side played by the harness, as in
``pd_agents``): a prefill with ``engine_id`` fixed, a decode that handshakes before every
request (``handshake_ttl`` 0: a restarted vLLM is down far longer than the 5 s default), and
the prefill started again on the same ports with the same engine id after ``kill -9``. The
decode then gets a READ and a WRITE naming the dead process (its ``remote_instance_id``, the
block ids it held). Both must be refused at once and load nothing: the new process's blocks at
those ids hold other KV (main loaded them and answered with wrong tokens; its WRITE waited for
``recv_abort_timeout``). Last, a request of the new process moves its KV.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Dict, List, Optional

from mori_core.bench.pd_agents import AgentProcess, free_port_block, layer_names

__all__ = ["RestartResult", "run_stale_kv"]

ENGINE_ID = "chaos-fixed-prefill"
SHAPE = dict(tp_rank=0, tp_size=1, total_heads=2, layers=2, num_blocks=32, heads=2, tokens=16, content=32)
RECV_ABORT_S = 8.0  # bounds main's WRITE wait; the refusal must come far sooner
REFUSE_BOUND_S = 2.0


@dataclasses.dataclass
class RestartResult:
    """Outcome of the attack: per replayed request how it ended, after how long, what it loaded."""

    rows: List[List[Any]] = dataclasses.field(default_factory=list)  # mode, ok, seconds, bytes loaded, reason
    failures: List[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def _spec(name: str, ports: Dict[str, int], instance: str, extra: Dict[str, Any]) -> Dict[str, Any]:
    cfg = {"backend": "tcp", "host_ip": "127.0.0.1", "handshake_port": ports["handshake"],
           "notify_port": ports["notify"], "transfer_timeout": 2, "recv_abort_timeout": RECV_ABORT_S,
           "defer_timeout": 30, "handshake_timeout": 3, **extra}
    return dict(SHAPE, engine_id=name, extra=cfg, instance_id=instance)


def _job(tid: str, mode: str, peer: Any, dst: List[int], src: Optional[List[int]], instance: Optional[str]) -> Any:
    from mori_integrations.vllm.kv_connector.metadata import RecvJob

    fields = dict(req_id=f"d-{tid}", transfer_id=tid, mode=mode, peer=peer, local_block_ids=[dst], positions=[0],
                  num_prompt_tokens=2 * SHAPE["tokens"] - 3, remote_block_ids=[src] if mode == "read" else None,
                  remote_engine_id=ENGINE_ID)
    if "remote_instance_id" in {f.name for f in dataclasses.fields(RecvJob)}:  # main had no process identity
        fields["remote_instance_id"] = instance
    return RecvJob(**fields)


def _send(prefill: AgentProcess, tid: str, blocks: List[int]) -> None:
    from mori_integrations.vllm.kv_connector.metadata import SendJob

    prefill.call("send", (SendJob(req_id=f"p-{tid}", transfer_id=tid, block_ids=[blocks],
                                  num_prompt_tokens=2 * SHAPE["tokens"] - 3), False))


def _loaded(decode: AgentProcess, blocks: List[int]) -> int:
    """Bytes of ``blocks`` on the decode that are not zero any more (they start zeroed)."""
    return int(sum((decode.call("read", (layer, blocks)) != 0).sum() * 4 for layer in layer_names(SHAPE["layers"])))


def _replay(decode: AgentProcess, job: Any) -> List[Any]:
    t0 = time.monotonic()
    decode.call("recv", job)
    (r,) = decode.call("results", (1, RECV_ABORT_S + 30), timeout=RECV_ABORT_S + 60)
    took = time.monotonic() - t0
    return [job.mode.upper(), r.ok, round(took, 3), _loaded(decode, job.local_block_ids[0]), r.reason[:150]]


def run_stale_kv() -> RestartResult:
    """Run the attack; rows are the replayed READ and WRITE, failures say what went wrong."""
    from mori_integrations.vllm.kv_connector.metadata import PeerAddress

    out = RestartResult()
    t_start = time.monotonic()
    ports = {"handshake": free_port_block(1), "notify": free_port_block(1)}
    dports = {"handshake": free_port_block(1), "notify": free_port_block(1)}
    peer = PeerAddress("127.0.0.1", ports["handshake"], ports["notify"], 0, 1)
    dead_instance, new_instance = uuid.uuid4().hex, uuid.uuid4().hex
    procs: List[AgentProcess] = []
    try:
        prefill = AgentProcess(_spec(ENGINE_ID, ports, dead_instance, {}))
        procs.append(prefill)
        decode = AgentProcess(_spec("chaos-decode", dports, uuid.uuid4().hex, {"handshake_ttl": 0}))
        procs.append(decode)
        prefill.call("fill", 1)
        _send(prefill, "legit-0", [3, 4])  # a request the first process serves ...
        decode.call("recv", _job("legit-0", "read", peer, [5, 6], [3, 4], dead_instance))
        (r,) = decode.call("results", (1, 30), timeout=60)
        if not r.ok:
            out.failures.append(f"the first process did not serve a legitimate READ: {r.reason}")
        _send(prefill, "stale", [7, 8])  # ... and one whose decode leg comes only after it died
        prefill.kill()
        restarted = AgentProcess(_spec(ENGINE_ID, ports, new_instance, {}))  # same ports, same engine id
        procs.append(restarted)
        restarted.call("fill", 2)
        out.rows.append(_replay(decode, _job("stale", "read", peer, [9, 10], [7, 8], dead_instance)))
        out.rows.append(_replay(decode, _job("stale-w", "write", peer, [11, 12], None, dead_instance)))
        for mode, ok, took, loaded, reason in out.rows:
            if ok or loaded:
                out.failures.append(f"{mode} of the dead process was served from the new one ({loaded} bytes loaded)")
            elif took > REFUSE_BOUND_S:
                out.failures.append(f"{mode} of the dead process refused only after {took:.1f} s "
                                    f"(bound {REFUSE_BOUND_S:g} s): {reason}")
        if restarted.call("pending")[0]:
            out.failures.append("the restarted prefill holds a write request meant for its predecessor")
        _send(restarted, "legit-1", [13, 14])
        decode.call("recv", _job("legit-1", "read", peer, [15, 16], [13, 14], new_instance))
        (r,) = decode.call("results", (1, 30), timeout=60)
        if not r.ok:
            out.failures.append(f"the restarted process did not serve a legitimate READ: {r.reason}")
    finally:
        for p in procs:
            p.close()
    out.seconds = time.monotonic() - t_start
    return out
