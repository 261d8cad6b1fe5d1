"""Fuzz rounds of the chaos harness: malformed input to every listener, then a checked transfer.

Each listener runs in its own process (so its RSS and descriptors are its own):

* ``io``     -- an IO engine's TCP port (handshake + TCP data channel);
* ``pd``     -- the vLLM PD connector's side channel (handshake ROUTER + notify PULL);
* ``omni``   -- the vLLM-Omni connector's pull ROUTER;
* ``sglang`` -- the SGLang PD bootstrap server (HTTP; needs sglang).

A round sends ``round_size`` inputs (random bytes, mutated valid messages,
invalid UTF-8, wrong lengths, truncated frames and resets), then requires the
listener to serve one legitimate transfer whose content is checked. Counts,
RSS and descriptors before/after come back as one row per listener.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from mori_core.bench.peer import LocalBuffer, TargetProcess, process_stats
from mori_core.bench.spawned import SpawnedProcess
from mori_core.bench.wire import HELLO_MAGIC, raw_handshake, request_header, send_msg

__all__ = ["FuzzResult", "LISTENERS", "fuzz_listener"]

SETTLE_S = 15.0  # how long a listener may take to close what the fuzzer left behind


@dataclass
class FuzzResult:
    """One listener's fuzz outcome."""

    listener: str
    inputs: int = 0
    rounds: int = 0
    checks_ok: int = 0
    failures: List[str] = field(default_factory=list)
    before: Dict[str, int] = field(default_factory=dict)
    after: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: str = ""

    @property
    def rss_growth(self) -> int:
        return self.after.get("rss", 0) - self.before.get("rss", 0)

    @property
    def fd_growth(self) -> int:
        return self.after.get("fds", 0) - self.before.get("fds", 0)


def _reset_close(s: socket.socket) -> None:
    """Close with an RST (no TIME_WAIT left on this side)."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()


def _mutate(rng: random.Random, data: bytes, flips: int = 4) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, flips)):
        op = rng.randrange(4)
        if op == 0 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif op == 1 and out:
            del out[rng.randrange(len(out)):][: rng.randint(1, 8)]
        elif op == 2:
            out[rng.randrange(len(out) + 1):0] = rng.randbytes(rng.randint(1, 8))
        else:
            out = out.replace(b"\xa1", b"\xa2\xff", 1) if b"\xa1" in out else out + b"\xff\xfe"
    return bytes(out)


# ------------------------------------------------------------------ IO engine
def _io_input(rng: random.Random, port: int, mem_id: int) -> None:
    kind = rng.randrange(6)
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        if kind == 0:  # random bytes instead of a hello
            s.sendall(rng.randbytes(rng.randint(1, 256)))
        elif kind == 1:  # a mutated hello
            hello = struct.pack("<IHB", HELLO_MAGIC, 2, 1) + rng.randbytes(32)
            send_msg(s, _mutate(rng, hello))
        elif kind == 2:  # a huge length prefix
            s.sendall(struct.pack("<I", rng.choice([4097, 1 << 20, 0xFFFFFFFF])) + rng.randbytes(16))
        else:  # a handshake, then a malformed or unauthenticated request
            s.close()
            s, verdict = raw_handshake(port, f"fuzz-{rng.randrange(1 << 30)}")
            h = request_header(op=rng.choice([1, 2, 3, 0]), flags=rng.choice([0, 1, 2]), mem=rng.choice([mem_id, 0, 99]),
                               nseg=rng.choice([0, 1, 2, 1 << 20]), req=rng.choice([1, 2, 0]),
                               total=rng.choice([8, 0, 1 << 40, 4096]), notify=rng.choice([0, 1]))
            if kind == 3:
                h = _mutate(rng, h)
            body = h + struct.pack("<QQ", rng.choice([0, 4096, 1 << 62]), rng.choice([8, 4096, 0]))
            s.sendall(body[: rng.randint(1, len(body))] if kind == 5 else body)
    except OSError:
        pass
    finally:
        _reset_close(s)


class _IoListener:
    def __init__(self) -> None:
        from mori_core.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig

        self.target = TargetProcess("chaos-io-target")
        self.engine = IOEngine("chaos-io-checker", IOEngineConfig("127.0.0.1", 0))
        self.engine.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2))
        self.engine.register_remote_engine(self.target.desc)
        self.region, self.rm = self.target.region(1 << 16)
        self.local = LocalBuffer(self.engine, 1 << 16)
        self.back = LocalBuffer(self.engine, 1 << 16)
        self.uid = 0

    def stats(self) -> Dict[str, int]:
        return self.target.stats()

    def send(self, rng: random.Random) -> None:
        _io_input(rng, self.target.desc.port, self.rm.id)

    def check(self, rng: random.Random) -> Optional[str]:
        from mori_core.io import StatusCode

        import numpy as np

        self.local.array[:] = np.frombuffer(rng.randbytes(self.local.array.size), dtype=np.uint8)
        self.uid += 2
        w = self.engine.write(self.local.desc, 0, self.rm, 0, self.local.array.size, self.uid)
        if w.WaitFor(15_000) != StatusCode.SUCCESS:
            return f"write failed: {w.Message()}"
        r = self.engine.read(self.back.desc, 0, self.rm, 0, self.back.array.size, self.uid + 1)
        if r.WaitFor(15_000) != StatusCode.SUCCESS:
            return f"read failed: {r.Message()}"
        if bytes(self.region) != self.local.array.tobytes() or (self.back.array != self.local.array).any():
            return "checksum mismatch"
        return None

    def close(self) -> None:
        self.region.release()
        self.target.close()


# ------------------------------------------------------------ PD side channel
def _pd_serve(pipe: Any) -> None:
    try:
        import zmq

        from mori_core.bench.pd_agents import free_port_block
        from mori_integrations.vllm.kv_connector.control import ControlServer
        from mori_integrations.vllm.kv_connector.messages import AgentMetadata, LayerLayout, make_codec

        layer = LayerLayout(name="l", group=0, region=0, offset=0, block_stride=64, head_stride=32, num_heads=2,
                            head_runs=[(0, 32)], block_runs=[(0, 64)], content="float32:4x2")
        meta = AgentMetadata(engine_id="chaos", engine_desc=b"d", regions=[b"r"], layers=[layer], tp_rank=0,
                             tp_size=1, dp_rank=0, total_kv_heads=2, replicated_heads=False, block_size=16,
                             group_block_sizes=[16], notify_host="127.0.0.1", notify_port=1)
        got: List[Any] = []
        base = free_port_block(2)
        ctx = zmq.Context()
        server = ControlServer(make_codec(""), ctx, "127.0.0.1", base, base + 1, lambda: meta, got.append, "chaos-pd")
    except Exception as exc:  # reported by SpawnedProcess
        pipe.send(exc)
        return
    pipe.send((base, base + 1))
    while True:
        cmd, arg = pipe.recv()
        if cmd == "stats":
            pipe.send(process_stats(os.getpid()))
        elif cmd == "notified":
            # The server thread appends while this one drains: take a snapshot and delete exactly
            # those entries (each step is atomic under the GIL), so a notification appended in
            # between stays for the next call. A plain clear() after the scan dropped it.
            taken = got[:]
            del got[:len(taken)]
            pipe.send([(m.transfer_id, m.nbytes) for m in taken if type(m).__name__ == "ConsumerDone"][-arg:])
        elif cmd == "stop":
            server.close()
            ctx.term()
            pipe.send(True)
            return


class _PdListener:
    def __init__(self) -> None:
        import zmq

        from mori_integrations.vllm.kv_connector.messages import ConsumerDone, make_codec

        self.proc = SpawnedProcess(_pd_serve, (), start_timeout=60, call_timeout=30)
        self.hport, self.nport = self.proc.hello
        self.codec = make_codec("")
        self.done_cls = ConsumerDone
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.dealer = self.ctx.socket(zmq.DEALER)
        for s, p in ((self.push, self.nport), (self.dealer, self.hport)):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100000)
            s.connect(f"tcp://127.0.0.1:{p}")
        self.valid = self.codec.encode(self._done("t", 1))

    def _done(self, tid: str, n: int) -> Any:
        return self.done_cls(transfer_id=tid, consumer_key="k", consumer_rank=0, consumer_tp=1, ok=True, nbytes=n)

    def stats(self) -> Dict[str, int]:
        return self.proc.call("stats")

    def send(self, rng: random.Random) -> None:
        kind = rng.randrange(5)
        frames = list(self.valid)
        if kind == 0:
            frames[2] = _mutate(rng, frames[2])
        elif kind == 1:
            frames = [rng.randbytes(rng.randint(0, 32)) for _ in range(rng.randint(1, 5))]
        elif kind == 2:
            frames[1] = rng.randbytes(rng.randint(0, 8))
        elif kind == 3:
            frames = frames + [rng.randbytes(56)]  # a tag this side cannot check
        else:  # raw bytes on the ZMQ port: a broken ZMTP greeting
            s = socket.create_connection(("127.0.0.1", rng.choice([self.hport, self.nport])), timeout=5)
            try:
                s.sendall(rng.randbytes(rng.randint(1, 128)))
            except OSError:
                pass
            _reset_close(s)
            return
        (self.dealer if rng.random() < 0.3 else self.push).send_multipart(frames)

    def check(self, rng: random.Random) -> Optional[str]:
        from mori_integrations.vllm.kv_connector.control import fetch_metadata

        if fetch_metadata(self.codec, self.ctx, "127.0.0.1", self.hport, "chaos", 10.0).engine_id != "chaos":
            return "wrong metadata"
        payload = rng.randbytes(64)
        tid, n = hashlib.sha256(payload).hexdigest(), len(payload) + rng.randrange(1 << 20)
        self.push.send_multipart(self.codec.encode(self._done(tid, n)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if (tid, n) in self.proc.call("notified", 1_000_000):
                return None
            time.sleep(0.05)
        return "legitimate notification not delivered"

    def close(self) -> None:
        self.push.close(0)
        self.dealer.close(0)
        self.ctx.term()
        self.proc.close()


# ---------------------------------------------------------------- Omni ROUTER
def _omni_serve(pipe: Any) -> None:
    try:
        from mori_core.bench.pd_agents import free_port_block
        from mori_integrations.vllm_omni.settings import ConnectorSettings
        from mori_integrations.vllm_omni.transport import OmniTransport

        port = free_port_block(1)
        transport = OmniTransport(ConnectorSettings.from_extra(
            {"host": "127.0.0.1", "zmq_port": port, "role": "sender", "memory_pool_size": "8M"}), "chaos")
    except Exception as exc:
        pipe.send(exc)
        return
    pipe.send(port)
    while True:
        cmd, arg = pipe.recv()
        if cmd == "stats":
            pipe.send(process_stats(os.getpid()))
        elif cmd == "offer":
            key, data = arg
            pipe.send(transport.offer(key, data, is_fast_path=True))
        elif cmd == "stop":
            transport.close()
            pipe.send(True)
            return


class _OmniListener:
    def __init__(self) -> None:
        import zmq

        from mori_integrations.vllm_omni import protocol
        from mori_integrations.vllm_omni.settings import ConnectorSettings
        from mori_integrations.vllm_omni.transport import OmniTransport

        self.proc = SpawnedProcess(_omni_serve, (), start_timeout=90, call_timeout=30)
        self.port = self.proc.hello
        self.receiver = OmniTransport(ConnectorSettings.from_extra(
            {"host": "127.0.0.1", "role": "receiver", "memory_pool_size": "8M"}), "chaos-check")
        self.protocol = protocol
        self.codec = protocol.make_codec()
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.SNDHWM, 100000)
        self.dealer.setsockopt(zmq.RCVHWM, 100000)
        self.dealer.connect(f"tcp://127.0.0.1:{self.port}")
        desc = self.receiver.engine_desc_packed
        self.samples = [
            self.codec.encode(protocol.QueryRequest(seq=1, key="k")),
            self.codec.encode(protocol.PullRequest(seq=2, key="k", engine_desc=desc, mem_desc=b"m", dst_offset=0,
                                                   length=8)),
        ]
        self.n = 0

    def stats(self) -> Dict[str, int]:
        return self.proc.call("stats")

    def send(self, rng: random.Random) -> None:
        import zmq

        kind = rng.randrange(5)
        frames = list(rng.choice(self.samples))
        if kind == 0:
            frames[2] = _mutate(rng, frames[2])
        elif kind == 1:
            frames = [rng.randbytes(rng.randint(0, 32)) for _ in range(rng.randint(1, 5))]
        elif kind == 2:
            frames[2] = b"\x83\xa4type\xa5query\xa3seq\x01\xa3key\xa2\xff\xfe"  # the frame of issue #21 item 1
        elif kind == 3:
            frames[1] = rng.choice([b"DONE", b"REJECT", rng.randbytes(4)])
        else:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            try:
                s.sendall(rng.randbytes(rng.randint(1, 128)))
            except OSError:
                pass
            _reset_close(s)
            return
        self.dealer.send_multipart(frames)
        try:
            while True:  # drain the refusals so they do not pile up
                self.dealer.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def check(self, rng: random.Random) -> Optional[str]:
        self.n += 1
        key = f"chaos-{self.n}"
        data = rng.randbytes(rng.randint(1, 1 << 20))
        self.proc.call("offer", (key, data))
        res = self.receiver.fetch(key, f"tcp://127.0.0.1:{self.port}", deadline=time.monotonic() + 20)
        if res is None:
            return "legitimate fetch failed"
        ok = res.buffer.to_bytes() == data
        res.buffer.release()
        return None if ok else "checksum mismatch"

    def close(self) -> None:
        self.dealer.close(0)
        self.ctx.term()
        self.receiver.close()
        self.proc.close()


# ------------------------------------------------------- SGLang bootstrap HTTP
def _sglang_serve(pipe: Any) -> None:
    try:
        from mori_integrations.sglang.bootstrap_server import MoriKVBootstrapServer

        server = MoriKVBootstrapServer("127.0.0.1", 0)
    except Exception as exc:
        pipe.send(exc)
        return
    pipe.send(server.port)
    while True:
        cmd, _ = pipe.recv()
        if cmd == "stats":
            pipe.send(process_stats(os.getpid()))
        elif cmd == "stop":
            pipe.send(True)
            return


_HTTP_SAMPLES = [
    b"GET /route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 96\r\n\r\n"
    b'{"role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0}',
    b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
]


class _SglangListener:
    def __init__(self) -> None:
        self.proc = SpawnedProcess(_sglang_serve, (), start_timeout=120, call_timeout=30)
        self.port = self.proc.hello

    def stats(self) -> Dict[str, int]:
        return self.proc.call("stats")

    def send(self, rng: random.Random) -> None:
        kind = rng.randrange(4)
        data = rng.choice(_HTTP_SAMPLES)
        if kind == 0:
            data = _mutate(rng, data, 8)
        elif kind == 1:
            data = rng.randbytes(rng.randint(1, 512))
        elif kind == 2:
            data = data.replace(b"Prefill", b"\xff\xfe", 1).replace(b"route?", b"route?\xff=\xfe&", 1)
        else:
            data = data[: rng.randint(1, len(data))]
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        try:
            s.sendall(data)
            if rng.random() < 0.2:  # sometimes read the answer (the rest are reset mid-request)
                s.settimeout(0.05)
                try:
                    s.recv(4096)
                except OSError:
                    pass
        except OSError:
            pass
        _reset_close(s)

    def check(self, rng: random.Random) -> Optional[str]:
        import json
        import urllib.request

        port = 1024 + rng.randrange(60000)
        body = {"role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
                "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": port, "page_size": 16,
                "kv_cache_dtype": "auto"}
        base = f"http://127.0.0.1:{self.port}"
        req = urllib.request.Request(f"{base}/route", data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
        query = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status != 200:
                    return f"PUT /route answered {r.status}"
            with urllib.request.urlopen(f"{base}/route?{query}", timeout=10) as r:
                got = json.loads(r.read())
        except Exception as exc:
            return f"legitimate request failed: {exc!r}"
        return None if got.get("rank_port") == port else f"GET /route gave {got}, expected rank_port {port}"

    def close(self) -> None:
        self.proc.close()


LISTENERS: Dict[str, Callable[[], Any]] = {
    "io": _IoListener,
    "pd": _PdListener,
    "omni": _OmniListener,
    "sglang": _SglangListener,
}


def _settled(listener: Any, before: Dict[str, int], fd_slack: int) -> Dict[str, int]:
    """Stats once the listener closed what the fuzzer left (bounded by SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        after = listener.stats()
        if after["fds"] <= before["fds"] + fd_slack or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def fuzz_listener(name: str, inputs: int, round_size: int = 500, seed: int = 21, fd_slack: int = 8,
                  time_limit_s: float = 600.0) -> FuzzResult:
    """Fuzz listener ``name`` with ``inputs`` malformed inputs (bounded by ``time_limit_s``)."""
    res = FuzzResult(name)
    rng = random.Random(seed)
    t0 = time.monotonic()
    try:
        listener = LISTENERS[name]()
    except ImportError as exc:
        res.skipped = f"not installed here ({exc.name or exc})"
        return res
    except Exception as exc:
        res.failures.append(f"listener did not start: {exc!r}")
        return res
    try:
        err = listener.check(rng)  # warm: the first transfer sets up connections
        if err:
            res.failures.append(f"before fuzzing: {err}")
            return res
        res.before = listener.stats()
        while res.inputs < inputs and time.monotonic() - t0 < time_limit_s:
            for _ in range(min(round_size, inputs - res.inputs)):
                listener.send(rng)
                res.inputs += 1
            res.rounds += 1
            err = listener.check(rng)
            if err:
                res.failures.append(f"round {res.rounds}: {err}")
                break
            res.checks_ok += 1
        res.after = _settled(listener, res.before, fd_slack)
        if res.inputs < inputs and not res.failures:
            res.failures.append(f"time limit: {res.inputs} of {inputs} inputs in {time_limit_s:.0f} s")
    except Exception as exc:  # a crashed listener process, a hang the bounds cut short
        res.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            listener.close()
        except Exception as exc:
            res.failures.append(f"close: {exc!r}")
        res.seconds = time.monotonic() - t0
    return res
