"""Attacks of the chaos harness on the Python control planes (issue #29), as an outsider would run them.

Each listener runs in its own process (its RSS and log are its own); the attacker is
this process, on loopback:

* ``replay``  -- cross-sender replay (Omni): two senders share the secret and hold a
  payload under the same key and length; a receiver's signed pull to the first one,
  captured, is sent again to the first and to the second. Counted: replays accepted,
  bytes of the receiver's buffer changed by them, and whether the receiver's own pull
  from the second sender still finds its payload.
* ``preauth`` -- pre-authentication memory (PD side channel, Omni sender, both with a
  secret): 30 messages of 60 MiB with a zero tag, one endless multipart message of
  32 KiB frames, 60 MiB handshake frames on 30 connections -- all over raw TCP (ZMTP),
  since libzmq's own sockets would not send some of them. Measured: the listener's RSS
  peak and end growth, and how long a legitimate notification (PD) or fetch (Omni) sent
  during the flood took.
* ``logflood`` -- bad input from many source addresses (127.1.x.y; no secret, so every
  message reaches the decoder): log lines and tracebacks the listener wrote.

Every step is bounded in count and time. Works against older trees too (it probes the
APIs it needs), so the same script measures "before" and "after".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from mori_core.bench import zmtp
from mori_core.bench.peer import process_stats
from mori_core.bench.spawned import SpawnedProcess

__all__ = ["ATTACKS", "AttackResult", "run_attack"]

SECRET = "chaos-attack-s3cret"
FLOOD_MESSAGES = 30
FLOOD_MESSAGE_BYTES = 60 << 20
LEGIT_BOUND_S = 2.0
RSS_BOUND_MIB = 64.0
LOG_LINES_PER_10K = 100
LOG_WINDOW_S = 10.0  # the listeners' log interval (RateLimitedLog's default)
SUMMARY_AFTER_LINES = 5  # a flood that got this many lines had more events than lines: a summary is due


@dataclass
class AttackResult:
    """One attack on one listener: its figures and what failed."""

    attack: str
    listener: str
    figures: Dict[str, Any] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str = ""


# ------------------------------------------------------------------ listeners
class _LogCounter(logging.Handler):
    """Counts WARNING+ records (and tracebacks) of the whole process; keeps the first few."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = 0
        self.tracebacks = 0
        self.first: List[str] = []
        self.summaries: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1
        self.tracebacks += bool(record.exc_info)
        text = record.getMessage()
        if len(self.first) < 3:
            self.first.append(text[:160])
        if "were not logged" in text and len(self.summaries) < 3:
            self.summaries.append(text[:200])


def _count_logs() -> _LogCounter:
    counter = _LogCounter()
    root = logging.getLogger()
    root.addHandler(counter)
    root.setLevel(logging.WARNING)
    return counter


def _pd_listener(pipe: Any, secret: str) -> None:
    """A PD ControlServer with a secret (or none); records when each notification arrived."""
    try:
        import zmq

        from mori_core.bench.pd_agents import free_port_block
        from mori_integrations.vllm.kv_connector.control import ControlServer
        from mori_integrations.vllm.kv_connector.messages import AgentMetadata, LayerLayout, make_codec

        logs = _count_logs()
        layer = LayerLayout(name="l", group=0, region=0, offset=0, block_stride=64, head_stride=32, num_heads=2,
                            head_runs=[(0, 32)], block_runs=[(0, 64)], content="float32:4x2")
        meta = AgentMetadata(engine_id="attack", engine_desc=b"d", regions=[b"r"], layers=[layer], tp_rank=0,
                             tp_size=1, dp_rank=0, total_kv_heads=2, replicated_heads=False, block_size=16,
                             group_block_sizes=[16], notify_host="127.0.0.1", notify_port=1)
        arrived: Dict[str, float] = {}
        base = free_port_block(2)
        ctx = zmq.Context()
        server = ControlServer(make_codec(secret), ctx, "127.0.0.1", base, base + 1, lambda: meta,
                               lambda m: arrived.setdefault(getattr(m, "transfer_id", "?"), time.monotonic()),
                               "attack-pd")
    except Exception as exc:
        pipe.send(exc)
        return
    pipe.send((base, base + 1))
    _serve_commands(pipe, logs, {"arrived": lambda tid: arrived.get(tid)},
                    lambda: (server.close(), ctx.term()))


def _omni_listener(pipe: Any, secret: str) -> None:
    """An Omni sender with a secret (or none)."""
    try:
        from mori_core.bench.pd_agents import free_port_block
        from mori_integrations.vllm_omni.settings import ConnectorSettings
        from mori_integrations.vllm_omni.transport import OmniTransport

        logs = _count_logs()
        port = free_port_block(1)
        transport = OmniTransport(ConnectorSettings.from_extra(
            {"host": "127.0.0.1", "zmq_port": port, "role": "sender", "memory_pool_size": "4M",
             "auth_secret": secret}), "attack")
    except Exception as exc:
        pipe.send(exc)
        return
    pipe.send(port)
    _serve_commands(pipe, logs, {"offer": lambda a: transport.offer(a[0], a[1], is_fast_path=True)},
                    transport.close)


def _serve_commands(pipe: Any, logs: _LogCounter, commands: Dict[str, Callable[[Any], Any]],
                    stop: Callable[[], Any]) -> None:
    while True:
        cmd, arg = pipe.recv()
        try:
            if cmd == "stats":
                pipe.send(process_stats(os.getpid()))
            elif cmd == "logs":
                pipe.send({"lines": logs.lines, "tracebacks": logs.tracebacks, "first": list(logs.first),
                           "summaries": list(logs.summaries)})
            elif cmd == "stop":
                stop()
                pipe.send(True)
                return
            else:
                pipe.send(commands[cmd](arg))
        except Exception as exc:
            pipe.send(exc)


def _spawn(target: Callable[..., None], secret: str) -> SpawnedProcess:
    return SpawnedProcess(target, (secret,), start_timeout=120, call_timeout=30)


class _RssPeak:
    """Samples a process's RSS every 20 ms on a thread (peak since start)."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.start = self.peak = process_stats(pid)["rss"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, process_stats(self._pid)["rss"])
            except OSError:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(2)
        return self.peak


# ----------------------------------------------------------- version probes
def _secure_client(sock: Any, codec: Any) -> None:
    """Set up a legitimate client socket the way this tree's connectors do (CURVE with a secret)."""
    try:
        from mori_integrations.common.zmq_setup import secure_client
    except ImportError:  # older trees: messages only
        return
    secure_client(sock, codec.secret, codec.max_frame_bytes)


def _encode(codec: Any, message: Any, recipient: str) -> List[bytes]:
    try:
        return codec.encode(message, recipient=recipient)
    except TypeError:  # older trees: messages are not bound to a recipient
        return codec.encode(message)


def _decode_reply(codec: Any, request: List[bytes], reply: List[bytes]) -> Any:
    binding = getattr(codec, "reply_binding", None)
    return codec.decode(reply, recipient=binding(request)) if binding else codec.decode(reply)


# ------------------------------------------------------------ cross-sender replay
def attack_replay() -> List[AttackResult]:
    """A receiver's pull, captured on its way to sender 1, replayed to sender 1 and to sender 2."""
    import zmq

    from mori_integrations.vllm_omni import protocol
    from mori_integrations.vllm_omni.settings import ConnectorSettings
    from mori_integrations.vllm_omni.transport import OmniTransport

    res = AttackResult("cross-sender replay", "omni")
    t0 = time.monotonic()
    senders = [_spawn(_omni_listener, SECRET) for _ in range(2)]
    receiver = OmniTransport(ConnectorSettings.from_extra(
        {"host": "127.0.0.1", "role": "receiver", "memory_pool_size": "4M", "auth_secret": SECRET}), "attack-rcv")
    ctx = zmq.Context()
    socks: List[Any] = []
    try:
        addresses = [f"tcp://127.0.0.1:{s.hello}" for s in senders]
        payloads = [os.urandom(4096), os.urandom(4096)]
        for s, data in zip(senders, payloads):
            s.call("offer", ("req-1@0_1", data))
        buffer = receiver.pool.alloc(4096)
        pull = protocol.PullRequest(seq=7, key="req-1@0_1", engine_desc=receiver.engine_desc_packed,
                                    mem_desc=receiver.pool.desc_packed, dst_offset=buffer.offset, length=4096)
        captured = _encode(receiver.codec, pull, addresses[0])

        def send(address: str, keyed: bool) -> Any:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if keyed:
                _secure_client(sock, receiver.codec)
            sock.connect(address)
            socks.append(sock)
            sock.send_multipart(captured)
            if not sock.poll(3000):
                return "no answer"
            try:
                reply = _decode_reply(receiver.codec, captured, sock.recv_multipart())
            except protocol.ProtocolError as exc:
                return f"undecodable reply: {exc}"
            return reply

        legit = send(addresses[0], True)  # the receiver's own pull, the one captured
        if not (isinstance(legit, protocol.PullResponse) and legit.ok) or buffer.to_bytes() != payloads[0]:
            res.failures.append(f"the legitimate pull did not land: {legit!r}")
            return [res]
        answers = {"replay to sender 1": send(addresses[0], True), "replay to sender 2": send(addresses[1], True),
                   "replay to sender 2, no CURVE keys": send(addresses[1], False)}
        accepted = [k for k, r in answers.items() if isinstance(r, protocol.PullResponse) and r.ok]
        changed = sum(a != b for a, b in zip(buffer.to_bytes(), payloads[0]))
        got = receiver.fetch("req-1@0_1", addresses[1], size=4096, is_fast_path=True,
                             deadline=time.monotonic() + 10)
        own_ok = got is not None and got.buffer.to_bytes() == payloads[1]
        if got is not None:
            got.buffer.release()
        buffer.release()
        res.figures = {"replays accepted": f"{len(accepted)} of {len(answers)}",
                       "receiver bytes overwritten": changed,
                       "receiver's own pull from sender 2": "ok" if own_ok else "payload gone",
                       "answers": "; ".join(f"{k}: {_short(r)}" for k, r in answers.items())}
        if accepted:
            res.failures.append(f"replays accepted: {accepted}")
        if changed:
            res.failures.append(f"{changed} bytes of the receiver's buffer overwritten")
        if not own_ok:
            res.failures.append("the receiver's own pull from sender 2 found nothing")
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        receiver.close()
        for s in senders:
            s.close()
        res.seconds = time.monotonic() - t0
    return [res]


def _short(reply: Any) -> str:
    if isinstance(reply, str):
        return reply
    reason = getattr(reply, "reason", None) or getattr(reply, "error", "")
    ok = getattr(reply, "ok", None)
    inside = ", ".join(str(x) for x in (ok, reason[:60]) if x not in (None, ""))
    return f"{type(reply).__name__}({inside})"


# ------------------------------------------------------------- pre-auth flood
def _flood_zero_tag(port: int, socket_type: str, guard: bytes, kind: bytes, stop: threading.Event) -> str:
    """30 x 60 MiB messages with a zero tag on one connection (the issue's attack)."""
    body = bytes(FLOOD_MESSAGE_BYTES)
    tag = bytes(56)
    sent = 0
    try:
        s = zmtp.connect(port, socket_type)
    except OSError as exc:
        return f"refused at the greeting ({type(exc).__name__})"
    try:
        for _ in range(FLOOD_MESSAGES):
            if stop.is_set():
                break
            s.sendall(zmtp.frame(guard, True) + zmtp.frame(kind, True) + zmtp.frame_header(len(body), more=True))
            s.sendall(body)
            s.sendall(zmtp.frame(tag))
            sent += 1
    except OSError as exc:
        return f"cut after {sent} messages ({type(exc).__name__})"
    finally:
        s.close()
    return f"all {sent} sent"


def _flood_endless_multipart(port: int, socket_type: str, stop: threading.Event) -> str:
    """32 KiB frames (under every frame bound) with the 'more' flag, never a last one (4,000 = 125 MiB)."""
    piece = zmtp.frame(bytes(32 << 10), more=True)
    sent = 0
    try:
        s = zmtp.connect(port, socket_type)
    except OSError as exc:
        return f"refused at the greeting ({type(exc).__name__})"
    try:
        for _ in range(4000):
            if stop.is_set():
                break
            s.sendall(piece)
            sent += 1
        stop.wait(1.0)  # hold the connection open while the listener is measured
    except OSError as exc:
        return f"cut after {sent} frames ({type(exc).__name__})"
    finally:
        s.close()
    return f"all {sent} frames sent"


def _flood_handshake_frames(port: int, stop: threading.Event) -> str:
    """30 connections with a CURVE greeting, each then sending one 60 MiB command frame."""
    body = bytes(FLOOD_MESSAGE_BYTES)
    results: List[str] = []

    def one() -> None:
        try:
            s = zmtp.connect(port, mechanism="CURVE")
        except OSError:
            results.append("refused")
            return
        try:
            s.sendall(zmtp.frame_header(len(body), command=True) + b"\x05HELLO")
            s.sendall(memoryview(body)[6:])
            results.append("sent")
            stop.wait(1.0)
        except OSError:
            results.append("cut")
        finally:
            s.close()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(FLOOD_MESSAGES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return ", ".join(f"{results.count(k)} {k}" for k in ("sent", "cut", "refused") if results.count(k))


def attack_preauth(listener: str, secret: str = SECRET) -> List[AttackResult]:
    """The three floods against ``listener`` ("pd" or "omni"), each on a fresh listener process
    (so one flood's memory cannot hide the next one's) with a legitimate message in the middle.

    Without a secret nothing is authenticated, and the endless multipart message is a known
    limit of libzmq (docs/reliability.md): its row is reported, not counted as a failure.
    """
    floods: List[tuple] = [
        ("30 x 60 MiB, zero tag", True,
         lambda t, stop: _flood_zero_tag(t.port, t.socket_type, t.guard, t.kind, stop)),
        ("endless multipart, 4,000 x 32 KiB", bool(secret),
         lambda t, stop: _flood_endless_multipart(t.port, t.socket_type, stop)),
        ("60 MiB handshake frame x 30 conns", True, lambda t, stop: _flood_handshake_frames(t.port, stop)),
    ]
    results = []
    for name, must_hold, flood in floods:
        if not secret:
            name += ", no secret"
        target = _PreauthTarget(listener, secret)
        try:
            if target.legit() is None:  # warm: connections and handshakes made before the flood
                results.append(AttackResult(f"pre-auth flood: {name}", listener,
                                            failures=["the legitimate message before the flood failed"]))
                continue
            res = _one_flood(target, name, lambda stop: flood(target, stop))
            if not must_hold and res.failures:
                res.figures["known limit"] = "no secret: libzmq keeps an unfinished multipart message"
                res.failures = []
            results.append(res)
        finally:
            target.close()
    return results


class _PreauthTarget:
    """A listener with a secret in its own process, and a legitimate client of it here."""

    def __init__(self, listener: str, secret: str) -> None:
        self.listener = listener
        self.secret = secret
        self.proc = _spawn(_pd_listener if listener == "pd" else _omni_listener, secret)
        self._cleanup: List[Callable[[], Any]] = [self.proc.close]
        self._n = 0
        try:
            if listener == "pd":
                self._pd_client()
            else:
                self._omni_client()
        except BaseException:
            self.close()
            raise

    def _pd_client(self) -> None:
        import zmq

        from mori_integrations.vllm.kv_connector.control import Notifier
        from mori_integrations.vllm.kv_connector.messages import GUARD, make_codec

        _, self.port = self.proc.hello
        self.socket_type, self.guard, self.kind = "PUSH", GUARD, b"WREQ"
        self._ctx = zmq.Context()
        self._notifier = Notifier(make_codec(self.secret), self._ctx)
        self._cleanup[:0] = [self._notifier.close, self._ctx.term]

    def _omni_client(self) -> None:
        from mori_integrations.vllm_omni.protocol import GUARD
        from mori_integrations.vllm_omni.settings import ConnectorSettings
        from mori_integrations.vllm_omni.transport import OmniTransport

        self.port = self.proc.hello
        self.socket_type, self.guard, self.kind = "DEALER", GUARD, b"PULL"
        self._receiver = OmniTransport(ConnectorSettings.from_extra(
            {"host": "127.0.0.1", "role": "receiver", "memory_pool_size": "4M", "auth_secret": self.secret}),
            "attack-rcv")
        self._cleanup.insert(0, self._receiver.close)

    def legit(self) -> Optional[float]:
        """Seconds a legitimate notification (PD) or fetch (Omni) took; None if it failed."""
        self._n += 1
        if self.listener == "pd":
            from mori_integrations.vllm.kv_connector.messages import ConsumerDone

            tid = f"legit-{self._n}-{os.urandom(4).hex()}"
            t0 = time.monotonic()
            self._notifier.send("127.0.0.1", self.port, ConsumerDone(
                transfer_id=tid, consumer_key="k", consumer_rank=0, consumer_tp=1, ok=True, nbytes=1))
            while time.monotonic() - t0 < 10:
                at = self.proc.call("arrived", tid)
                if at is not None:
                    return at - t0
                time.sleep(0.01)
            return None
        key, data = f"legit-{self._n}@0_1", os.urandom(4096)
        self.proc.call("offer", (key, data))
        t0 = time.monotonic()
        got = self._receiver.fetch(key, f"tcp://127.0.0.1:{self.port}", size=len(data), is_fast_path=True,
                                   deadline=t0 + 10)
        took = time.monotonic() - t0
        if got is None:
            return None
        ok = got.buffer.to_bytes() == data
        got.buffer.release()
        return took if ok else None

    def close(self) -> None:
        for fn in self._cleanup:
            try:
                fn()
            except Exception:
                pass
        self._cleanup = []


def _one_flood(target: "_PreauthTarget", name: str, flood: Callable[[threading.Event], str]) -> AttackResult:
    res = AttackResult(f"pre-auth flood: {name}", target.listener)
    proc = target.proc
    t0 = time.monotonic()
    before = proc.call("stats")["rss"]
    sampler = _RssPeak(proc.proc.pid)
    stop = threading.Event()
    outcome: List[str] = []
    attacker = threading.Thread(target=lambda: outcome.append(flood(stop)), daemon=True)
    attacker.start()
    time.sleep(0.3)  # the flood is under way
    took = target.legit()
    attacker.join(120)
    stop.set()
    peak = sampler.stop()
    time.sleep(1.0)
    after = proc.call("stats")["rss"]
    res.seconds = time.monotonic() - t0
    mib = 1 << 20
    res.figures = {"RSS peak growth MiB": round((peak - before) / mib, 1),
                   "RSS end growth MiB": round((after - before) / mib, 1),
                   "legit message during flood s": "not delivered" if took is None else round(took, 3),
                   "attacker": outcome[0] if outcome else "did not finish"}
    if (peak - before) / mib > RSS_BOUND_MIB:
        res.failures.append(f"RSS grew by {(peak - before) / mib:.0f} MiB (bound {RSS_BOUND_MIB:g})")
    if took is None or took > LEGIT_BOUND_S:
        res.failures.append("legitimate message " + ("not delivered" if took is None else f"took {took:.2f} s")
                            + f" (bound {LEGIT_BOUND_S:g} s)")
    return res


# ------------------------------------------------------ many-source log flood
def attack_log_flood(listener: str, inputs: int, sources: int) -> List[AttackResult]:
    """``inputs`` bad messages from ``sources`` addresses 127.1.x.y to an unauthenticated listener."""
    res = AttackResult("many-source bad-input log flood", listener)
    t0 = time.monotonic()
    proc = _spawn(_pd_listener if listener == "pd" else _omni_listener, "")
    try:
        if listener == "pd":
            from mori_integrations.vllm.kv_connector.messages import GUARD

            ports = [(proc.hello[1], "PUSH"), (proc.hello[0], "DEALER")]
        else:
            from mori_integrations.vllm_omni.protocol import GUARD

            ports = [(proc.hello, "DEALER")]
        base = proc.call("logs")["lines"]
        per_source = max(1, inputs // sources)
        sent = 0
        i = 0
        open_socks: List[Any] = []  # closed late: a close with unread replies would reset the connection
        try:
            while sent < inputs and time.monotonic() - t0 < max(60.0, inputs / 50):
                port, socket_type = ports[i % len(ports)]
                source = f"127.1.{(i // 250) % 250 + 1}.{i % 250 + 1}"
                i += 1
                n = min(per_source, inputs - sent)
                bad = zmtp.message([GUARD, b"QUERY" if listener == "omni" else b"CDONE", b"\xc1" + os.urandom(8)])
                try:
                    s = zmtp.connect(port, socket_type, source=source)
                except OSError as exc:
                    res.failures.append(f"could not connect from {source}: {exc}")
                    break
                open_socks.append(s)
                try:
                    s.sendall(bad * n)
                    sent += n
                except OSError:
                    pass
                if len(open_socks) > 256:
                    open_socks.pop(0).close()
            time.sleep(1.0)  # the listener drains what was sent
        finally:
            for s in open_socks:
                s.close()
        logs = proc.call("logs")
        if logs["lines"] - base >= SUMMARY_AFTER_LINES:  # lines were dropped: the summary follows the window
            deadline = time.monotonic() + LOG_WINDOW_S + 2
            while time.monotonic() < deadline and not logs["summaries"]:
                time.sleep(0.5)
                logs = proc.call("logs")
        lines = logs["lines"] - base
        res.figures = {"inputs": sent, "sources": i, "log lines": lines, "tracebacks": logs["tracebacks"],
                       "lines per 10,000 inputs": round(lines * 10_000 / max(1, sent), 1),
                       "summary line": (logs["summaries"] or ["none"])[0][:120]}
        if sent < inputs:
            res.failures.append(f"only {sent} of {inputs} inputs sent in time")
        if lines * 10_000 > LOG_LINES_PER_10K * max(1, sent):
            res.failures.append(f"{lines} log lines for {sent} inputs (bound {LOG_LINES_PER_10K} per 10,000)")
        if logs["tracebacks"]:
            res.failures.append(f"{logs['tracebacks']} tracebacks logged")
        if lines >= SUMMARY_AFTER_LINES and not logs["summaries"]:
            res.failures.append(f"no summary line of the events not logged within {LOG_WINDOW_S + 2:g} s")
    finally:
        proc.close()
        res.seconds = time.monotonic() - t0
    return [res]


ATTACKS: Dict[str, Callable[[int], List[AttackResult]]] = {
    "replay": lambda inputs: attack_replay(),
    "preauth-pd": lambda inputs: attack_preauth("pd"),
    "preauth-omni": lambda inputs: attack_preauth("omni"),
    "preauth-pd-nosecret": lambda inputs: attack_preauth("pd", secret=""),
    "logflood-pd": lambda inputs: attack_log_flood("pd", inputs, min(1000, max(1, inputs // 4))),
    "logflood-omni": lambda inputs: attack_log_flood("omni", inputs, min(1000, max(1, inputs // 4))),
}


def run_attack(name: str, inputs: int) -> List[AttackResult]:
    """Run attack ``name`` (a key of :data:`ATTACKS`); ``inputs`` sizes the log flood."""
    t0 = time.monotonic()
    try:
        results = ATTACKS[name](inputs)
    except ImportError as exc:
        return [AttackResult(name, "-", skipped=f"not installed here ({exc.name or exc})")]
    except Exception as exc:  # a crashed listener, a hang the bounds cut short
        return [AttackResult(name, "-", failures=[f"{type(exc).__name__}: {exc}"], seconds=time.monotonic() - t0)]
    return results
