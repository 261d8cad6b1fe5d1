"""The PD connector's worker side (``TransferAgent``) in separate processes, with vLLM-style KV.

Used by ``python -m mori_core.bench vllm-pd --agents`` and by the tests that fake only
vLLM's side (CPU over TCP, GPUs over XGMI). Each :class:`AgentProcess` hosts a real
agent (IO engine, control plane, producer/consumer state machines) over KV views laid
out like vLLM 0.30's ``allocate_kv_cache``: one int8 backing buffer, a 5D strided view
``[layers, kernel blocks, heads, tokens, content]`` whose physical dim order is the KV
cache layout (``LBHNC``, ``LBNHC``, ``BLHNC``) and a 4D view per layer. The test or
benchmark plays vLLM's scheduler: it hands out block ids, send jobs and receive jobs.
"""

from __future__ import annotations

import random
import socket
import time
import traceback
import uuid
from typing import Any, Dict, List

from mori_core.bench.spawned import SpawnedProcess

LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4)}
_POLL_S = 0.002


def layer_names(num_layers: int) -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_kv_views(num_layers: int, num_blocks: int, heads: int, tokens: int, content: int, dtype: Any = None,
                  layout: str = "LBHNC", device: str = "cpu", ratio: int = 1) -> Dict[str, Any]:
    """Layer name -> 4D view ``[num_blocks * ratio, heads, tokens / ratio, content]``, one zeroed buffer."""
    import torch

    dtype = dtype or torch.float32
    elem = torch.empty(0, dtype=dtype).element_size()
    logical = [num_layers, num_blocks * ratio, heads, tokens // ratio, content * elem]
    strides = [0] * 5
    running = 1
    for axis in reversed(LAYOUTS[layout]):
        strides[axis] = running
        running *= logical[axis]
    buf = torch.zeros(running, dtype=torch.int8, device=device)
    view5 = torch.as_strided(buf, logical, strides)
    return {name: view5[i].view(dtype) for i, name in enumerate(layer_names(num_layers))}


def block_heads(view: Any, blocks: List[int], ratio: int = 1) -> Any:
    """Manager blocks of one layer as a host array ``[n, heads, tokens, content]`` (logical order)."""
    import torch

    parts = [view[b * ratio:(b + 1) * ratio].permute(1, 0, 2, 3).reshape(view.shape[1], -1, view.shape[3])
             for b in blocks]
    return torch.stack(parts).float().cpu().numpy()


def _serve(pipe: Any, spec: Dict[str, Any]) -> None:
    import os

    for k, v in spec.get("env", {}).items():  # engine knobs (MORI_IO_*), read when the engine is made
        os.environ[k] = str(v)
    import torch

    from mori_integrations.vllm.kv_connector.agent import AgentIdentity, TransferAgent
    from mori_integrations.vllm.kv_connector.config import ConnectorConfig

    device = spec.get("device", "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    ratio = spec.get("ratio", 1)
    kv = make_kv_views(spec["layers"], spec["num_blocks"], spec["heads"], spec["tokens"], spec["content"],
                       getattr(torch, spec.get("dtype", "float32")), spec.get("layout", "LBHNC"), device, ratio)
    ident = AgentIdentity(engine_id=spec["engine_id"], tp_rank=spec["tp_rank"], tp_size=spec["tp_size"], dp_rank=0,
                          total_kv_heads=spec["total_heads"], replicated_heads=False,
                          group_block_sizes=[spec["tokens"]])
    try:
        agent = TransferAgent(ConnectorConfig.from_extra(spec["extra"]), ident, kv, {n: 0 for n in kv},
                              spec["num_blocks"])
    except Exception:
        pipe.send(RuntimeError(traceback.format_exc()))
        return
    # What vLLM's scheduler hands its workers with every step: the server instance's nonce.
    agent.bind_instance(spec.get("instance_id") or uuid.uuid4().hex)
    submit_threads: List[str] = []  # which threads wrote (prefill) or read (decode) KV
    if spec.get("submit_inline"):
        # Tests: treat every route as XGMI's (submitting only queues copies), so the paths that
        # submit from the control thread (prefill) and from the model thread (decode) run over
        # TCP, whose submit then blocks those threads for the transfer (correct, only slower).
        agent.submits_async = lambda peer: True
    if spec.get("drop_write_done"):
        # Tests: this decode never hears a WriteDone message, so only the prefill's doorbell
        # can finish its WRITEs (a failed write then ends at recv_abort_timeout).
        agent.consumer.on_write_done = lambda note: None
    if spec.get("submit_inline") or spec.get("record_submit_threads"):
        import threading

        run_item, read = agent.producer._run_item, agent.consumer._read

        def traced_run_item(item: Any) -> None:
            submit_threads.append(threading.current_thread().name)
            run_item(item)

        def traced_read(recv: Any, producers: Any, submit_only: bool = False) -> None:
            submit_threads.append(threading.current_thread().name)
            read(recv, producers, submit_only)

        agent.producer._run_item, agent.consumer._read = traced_run_item, traced_read
    any_kv = next(iter(kv.values()))
    collected: List[Any] = []

    def wait_for(fn: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = fn()
            if value or time.monotonic() > deadline:
                return value
            time.sleep(_POLL_S)

    def results(arg: Any) -> List[Any]:
        n, timeout = arg
        deadline = time.monotonic() + timeout
        while True:
            collected.extend(agent.consumer.take_results())
            left = deadline - time.monotonic()
            if len(collected) >= n or left <= 0:
                break
            agent.consumer.wait_ended(min(left, 0.5))  # woken when an outcome is recorded
        out = list(collected)
        collected.clear()
        return out

    def fill(seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        for view in kv.values():
            view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def send(arg: Any) -> None:
        job, pipelined = arg
        agent.producer.begin_step([job], [])
        if pipelined:  # what vLLM's attention layers do while the forward runs
            for name, view in kv.items():
                agent.producer.on_layer_saved(name, view)
        agent.producer.end_step(any_kv)

    sleep_cycles_per_us: List[float] = []

    def forward(arg: Any) -> int:
        """A last-chunk step with ``layer_us`` of GPU work per layer (a spinning kernel) before each
        layer's KV is saved, as vLLM's forward does; returns when the GPU finished it (perf_counter_ns)."""
        job, layer_us = arg
        if not sleep_cycles_per_us:  # calibrate the spin kernel once
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(10_000_000)
            b.record()
            b.synchronize()
            sleep_cycles_per_us.append(10_000_000 / (a.elapsed_time(b) * 1000))
        cycles = int(layer_us * sleep_cycles_per_us[0])
        agent.producer.begin_step([job], [])
        for name, view in kv.items():
            torch.cuda._sleep(cycles)
            agent.producer.on_layer_saved(name, view)
        agent.producer.end_step(any_kv)
        # The forward's stream only: a device-wide synchronize would also wait for the KV copies
        # (the engine's streams do not block on it, nor it on them).
        torch.cuda.current_stream().synchronize()
        return time.perf_counter_ns()

    def recv_wait(arg: Any) -> tuple:
        """Start a receive job and wait for its outcome here (no polling interval, no pipe in the
        timing): (result, ms from the start until the outcome was seen, perf_counter_ns then)."""
        job, timeout = arg
        t0 = time.perf_counter_ns()
        agent.consumer.start([job])
        deadline = time.monotonic() + timeout
        while True:
            for r in agent.consumer.take_results():
                if r.req_id == job.req_id:
                    t1 = time.perf_counter_ns()
                    return r, (t1 - t0) / 1e6, t1
                collected.append(r)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no outcome of {job.req_id} within {timeout} s")
            agent.consumer.wait_ended(min(left, 1.0))

    def trace(arg: Any) -> Any:
        """("on"|"off", None) switches phase stamps; ("take", transfer_id) returns and forgets them."""
        what, tid = arg
        if what == "take":
            return agent.trace.take(tid)
        agent.trace.enabled = what == "on"
        return None

    handlers = {
        "info": lambda _: {"engine_key": agent.engine_key, "handshake_port": agent.handshake_port,
                           "notify_port": agent.notify_port, "backends": agent.backends,
                           "instance": agent.metadata.instance, "doorbell": getattr(agent.metadata, "doorbell", "")},
        "fill": fill,
        "read": lambda arg: block_heads(kv[arg[0]], arg[1], ratio),
        "send": send,
        "forward": forward,
        "recv_wait": recv_wait,
        "trace": trace,
        "finish": lambda note: agent.producer.begin_step([], [note]),
        "take_finished": lambda timeout: sorted(wait_for(agent.producer.take_finished, timeout)),
        "recv": lambda job: agent.consumer.start([job]),
        "results": results,
        "abort": lambda req_ids: agent.consumer.abort(set(req_ids)),
        "totals": lambda _: dict(agent.counters.totals),
        "pending": lambda _: (agent.producer.has_pending(), agent.consumer.has_pending()),
        "peer_routes": lambda _: agent.peer_routes(),
        "submit_threads": lambda _: list(submit_threads),
        "inbox_messages": lambda _: getattr(agent.control, "inbox_messages", 0),
    }
    pipe.send("ready")
    while True:
        cmd, arg = pipe.recv()
        if cmd == "stop":
            agent.close()
            pipe.send(True)
            return
        try:
            pipe.send(handlers[cmd](arg))
        except Exception:
            pipe.send(RuntimeError(f"agent {spec['engine_id']} tp{spec['tp_rank']}: {cmd} failed:\n"
                                   f"{traceback.format_exc()}"))


class AgentProcess(SpawnedProcess):
    """One worker's agent in a spawned process; :meth:`call` runs a command there (bounded).

    ``spec`` keys: engine_id, tp_rank, tp_size, total_heads, layers, num_blocks, heads (local),
    tokens (per block), content, extra (connector config); optional dtype, layout, device, ratio,
    env (environment variables set before the agent's engine is made, e.g. ``MORI_IO_XGMI_*``).
    submit_inline (tests: take every route for one that submits without blocking, see ``_serve``),
    record_submit_threads (tests: the ``submit_threads`` command names the threads that wrote / read).
    drop_write_done (tests: the agent ignores WriteDone messages; only doorbells finish its WRITEs).
    instance_id (the server instance's nonce, as vLLM's scheduler would hand it; default: a fresh one).
    """

    def __init__(self, spec: Dict[str, Any], start_timeout: float = 180.0, call_timeout: float = 120.0) -> None:
        super().__init__(_serve, (spec,), start_timeout, call_timeout)
        self.spec = spec
        self.info = self.call("info")


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned ports (connect(), bind to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port_block(n: int, tries: int = 200) -> int:
    """A base port with ``base .. base+n-1`` free right now.

    Picked at random below the kernel's ephemeral range: a port found free by binding port 0
    lies inside that range, so any other process's outgoing connection or ``bind(0)`` (vLLM and
    torch open many while a server starts) may take it before our server binds it. Ports
    outside the range are only ever taken by someone asking for them explicitly."""
    lo, _ = _ephemeral_range()
    low, high = (10000, lo - 1) if lo > 10000 + 2 * n else (lo, 65000)
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high - n)
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
