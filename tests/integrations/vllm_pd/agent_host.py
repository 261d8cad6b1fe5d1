"""A ``TransferAgent`` (the connector's worker side) in its own process, driven over a pipe.

The process fakes vLLM's side only: KV views laid out like vLLM's
(:mod:`kv_views`), ranks and block ids from the test; the agent, its IO engine,
control plane and threads are the real ones. Used by the CPU tests (TCP) and the
GPU test (XGMI) through :class:`AgentProcess`.
"""

from __future__ import annotations

import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "io"))  # tests/io: the PeerProcess base

from io_peer import PeerProcess  # noqa: E402

WAIT_POLL_S = 0.02


def _serve(pipe, spec: Dict[str, Any]) -> None:
    sys.path.insert(0, str(HERE))
    import torch

    from kv_views import block_heads, make_kv_views
    from mori_integrations.vllm.kv_connector.agent import AgentIdentity, TransferAgent
    from mori_integrations.vllm.kv_connector.config import ConnectorConfig

    device = spec.get("device", "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    kv = make_kv_views(spec["layers"], spec["num_blocks"], spec["heads"], spec["tokens"], spec["content"],
                       getattr(torch, spec.get("dtype", "float32")), spec.get("layout", "LBHNC"), device,
                       spec.get("ratio", 1))
    ident = AgentIdentity(engine_id=spec["engine_id"], tp_rank=spec["tp_rank"], tp_size=spec["tp_size"], dp_rank=0,
                          total_kv_heads=spec["total_heads"], replicated_heads=False,
                          group_block_sizes=[spec["tokens"]])
    agent = TransferAgent(ConnectorConfig.from_extra(spec["extra"]), ident, kv, {n: 0 for n in kv}, spec["num_blocks"])
    pipe.send(agent.engine.get_engine_desc().pack())
    any_kv = next(iter(kv.values()))

    def wait_for(fn, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            value = fn()
            if value or time.monotonic() > deadline:
                return value
            time.sleep(WAIT_POLL_S)

    collected: List[Any] = []

    def results(arg):
        n, timeout = arg
        def poll():
            collected.extend(agent.consumer.take_results())
            return len(collected) >= n
        wait_for(poll, timeout)
        out = list(collected)
        collected.clear()
        return out

    def fill(seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        for view in kv.values():
            view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def send(arg) -> None:
        job, pipelined = arg
        agent.producer.begin_step([job], [])
        if pipelined:
            for name, view in kv.items():
                agent.producer.on_layer_saved(name, view)
        agent.producer.end_step(any_kv)

    handlers = {
        "info": lambda _: {"engine_key": agent.engine_key, "handshake_port": agent.handshake_port,
                           "notify_port": agent.notify_port, "backends": agent.backends},
        "fill": fill,
        "read": lambda arg: block_heads(kv[arg[0]], arg[1], spec.get("ratio", 1)),
        "send": send,
        "finish": lambda note: agent.producer.begin_step([], [note]),
        "take_finished": lambda timeout: sorted(wait_for(agent.producer.take_finished, timeout)),
        "recv": lambda job: agent.consumer.start([job]),
        "results": results,
        "abort": lambda req_ids: agent.consumer.abort(set(req_ids)),
        "totals": lambda _: dict(agent.counters.totals),
        "pending": lambda _: (agent.producer.has_pending(), agent.consumer.has_pending()),
        "routes": lambda _: sorted({str(b.name) for b in agent.engine.backends()}),
    }
    while True:
        cmd, arg = pipe.recv()
        if cmd == "stop":
            agent.close()
            pipe.send(True)
            return
        try:
            pipe.send(handlers[cmd](arg))
        except Exception:
            pipe.send(RuntimeError(f"agent {spec['engine_id']} tp{spec['tp_rank']}: {cmd} failed:\n{traceback.format_exc()}"))


def free_port_block(n: int, tries: int = 200) -> int:
    """A base port with ``base .. base+n-1`` free right now."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65000:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no block of {n} free ports found")


class AgentProcess(PeerProcess):
    """One worker's agent; ``spec`` keys: engine_id, tp_rank, tp_size, total_heads, layers, num_blocks,
    heads (local), tokens (per block), content, extra (connector config) [dtype, layout, device, ratio]."""

    def __init__(self, spec: Dict[str, Any], start_timeout: float = 120.0, call_timeout: float = 120.0) -> None:
        super().__init__(_serve, (spec,), start_timeout=start_timeout, call_timeout=call_timeout)
        self.spec = spec
        self.info = self.call("info")
