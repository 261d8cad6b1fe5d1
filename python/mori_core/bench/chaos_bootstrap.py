"""Chaos attacks on the SGLang PD bootstrap server (``MoriKVBootstrapServer``; needs sglang).

* ``bootstrap-flood``: bad input of every kind (malformed HTTP, invalid JSON, wrong types,
  out-of-range ranks and rooms, oversized bodies, random and mutated requests, resets); counts
  the answers by class and what the server process logged (lines, tracebacks), then checks a
  legitimate registration. Issue #29: main logged 11,003 lines (511 tracebacks) and answered
  224 HTTP 500s for 600 inputs.
* ``bootstrap-forgery``: two servers sharing ``MORI_IO_AUTH_SECRET``; an attacker without the
  secret re-registers a prefill rank (unsigned, signed with another secret, a captured
  registration replayed to the same server, replayed to the other server, its tag moved onto
  another body). Every forgery must be refused and the registry keep the legitimate address.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

from mori_core.bench.spawned import SpawnedProcess

__all__ = ["BootstrapResult", "run_bootstrap_flood", "run_bootstrap_forgery", "sglang_missing"]

SECRET = "chaos-bootstrap-secret"
REGISTRATION = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
                "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
                "rank_ip": "127.0.0.1", "rank_port": 5001, "page_size": 16, "kv_cache_dtype": "auto"}
QUERY = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
MAX_LOG_LINES = 100  # issue #29's target for 10,000 inputs


@dataclasses.dataclass
class BootstrapResult:
    """One attack's figures and failures."""

    figures: Dict[str, Any] = dataclasses.field(default_factory=dict)
    failures: List[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    skipped: str = ""


def sglang_missing() -> str:
    """Why the attacks cannot run here ("" when sglang is importable)."""
    import importlib.util

    return "" if importlib.util.find_spec("sglang") is not None else "skipped (sglang not installed)"


class _LogCount(logging.Handler):
    """Counts what the server process logs: records, printed lines (tracebacks included), tracebacks."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records = self.lines = self.tracebacks = 0
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        self.records += 1
        self.lines += len(text.splitlines())
        self.tracebacks += bool(record.exc_info)
        self.last = text.splitlines()[0][:300]


def _serve(pipe: Any, secret: str, servers: int) -> None:
    if secret:
        os.environ["MORI_IO_AUTH_SECRET"] = secret
    else:
        os.environ.pop("MORI_IO_AUTH_SECRET", None)
    counter = _LogCount()
    root = logging.getLogger()
    root.addHandler(counter)
    root.setLevel(logging.INFO)
    try:
        from mori_integrations.sglang.bootstrap_server import MoriKVBootstrapServer

        made = [MoriKVBootstrapServer("127.0.0.1", 0) for _ in range(servers)]
    except Exception as exc:
        pipe.send(exc)
        return
    start = (counter.records, counter.lines, counter.tracebacks)  # the start-up lines are not the attack's
    pipe.send([(int(s.port), str(getattr(s, "identity", ""))) for s in made])
    while True:
        cmd, _ = pipe.recv()
        if cmd == "logs":
            pipe.send({"records": counter.records - start[0], "lines": counter.lines - start[1],
                       "tracebacks": counter.tracebacks - start[2], "last": counter.last})
        elif cmd == "stop":
            for s in made:
                s.close()
            pipe.send(True)
            return


def _http(port: int, method: str, path: str, body: Optional[bytes] = None,
          headers: Optional[Dict[str, str]] = None) -> Tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _raw(port: int, data: bytes, reset: bool) -> int:
    """Send raw bytes; the answer's HTTP status, 0 without one (``reset``: hang up at once with an RST)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(data)
        if reset:
            return 0
        answer = b""
        while len(answer) < 16:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        parts = answer.split(b" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    except OSError:
        return 0
    finally:
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()


def _registered_port(port: int) -> Optional[int]:
    status, body = _http(port, "GET", QUERY)
    return json.loads(body).get("rank_port") if status == 200 else None


def _bad_input(rng: random.Random, port: int) -> int:
    """One bad input of a random kind; the answer's status (0: none)."""
    good = json.dumps(REGISTRATION).encode()
    put = lambda body: _http(port, "PUT", "/route", body)[0]  # noqa: E731
    kind = rng.randrange(12)
    if kind == 0:
        return put(good[: rng.randrange(1, len(good))])  # truncated JSON
    if kind == 1:
        return put(json.dumps({**REGISTRATION, rng.choice(list(REGISTRATION)): rng.choice(["x", None, -5, [1]])}).encode())
    if kind == 2:
        return put(json.dumps({k: v for k, v in REGISTRATION.items() if rng.random() < 0.7}).encode())
    if kind == 3:
        return put(json.dumps({**REGISTRATION, "attn_tp_rank": rng.randrange(1, 1 << 40)}).encode())
    if kind == 4:
        return put(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
    if kind == 5:
        return _http(port, "GET", QUERY.replace("=0", f"={rng.choice(['x', '1e9', '', '-7', '0x1'])}", 1))[0]
    if kind == 6:
        return _http(port, "POST", "/register_dp_rank", json.dumps(
            {"bootstrap_room": rng.choice([-1, "r", 1 << 70, None]), "dp_rank": 0}).encode())[0]
    if kind == 7:
        return _http(port, "POST", "/query_dp_ranks", rng.choice([b"{}", b'{"bootstrap_rooms": "x"}', b"[", b"\xff"]))[0]
    if kind == 8:
        return put(b"{" + b" " * (rng.randrange(70, 200) << 10) + b"}")
    if kind == 9:
        line = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
        return _raw(port, line + b"\r\n\r\n", reset=False)
    if kind == 10:
        return _raw(port, b"GET /route?prefill_dp_rank=\xff\xfe&x=\x00 HTTP/1.1\r\nHost: x\r\n\r\n", reset=False)
    request = b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n" + good[:40]
    return _raw(port, request, reset=True)  # reset mid-body


def run_bootstrap_flood(inputs: int, seed: int = 29) -> BootstrapResult:
    """``inputs`` bad inputs at one server, then a legitimate registration."""
    out = BootstrapResult()
    out.skipped = sglang_missing()
    if out.skipped:
        return out
    t0 = time.monotonic()
    proc = SpawnedProcess(_serve, ("", 1), start_timeout=180, call_timeout=30)
    try:
        ((port, _),) = proc.hello
        rng = random.Random(seed)
        answers = {"2xx": 0, "3xx": 0, "4xx": 0, "5xx": 0, "none": 0}
        for _ in range(inputs):
            answers[{2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}.get(_bad_input(rng, port) // 100, "none")] += 1
        status, _ = _http(port, "PUT", "/route", json.dumps(REGISTRATION).encode())
        legit = status == 200 and _registered_port(port) == REGISTRATION["rank_port"]
        time.sleep(0.5)  # let the server's last log lines land
        logs = proc.call("logs")
    finally:
        proc.close()
    out.seconds = time.monotonic() - t0
    out.figures = {"inputs": inputs, **answers, "log lines": logs["lines"], "tracebacks": logs["tracebacks"],
                   "legitimate registration": "ok" if legit else "FAILED", "last line": logs["last"]}
    if answers["5xx"]:
        out.failures.append(f"{answers['5xx']} answers were HTTP 5xx")
    if logs["tracebacks"]:
        out.failures.append(f"{logs['tracebacks']} tracebacks logged")
    if logs["lines"] > MAX_LOG_LINES:
        out.failures.append(f"{logs['lines']} log lines (bound {MAX_LOG_LINES})")
    if not legit:
        out.failures.append("the legitimate registration after the flood failed")
    return out


def run_bootstrap_forgery() -> BootstrapResult:
    """Forged and replayed ``PUT /route`` against two servers that share a secret."""
    out = BootstrapResult()
    out.skipped = sglang_missing()
    if out.skipped:
        return out
    try:  # main had no registration authentication: its "legitimate" registration is unsigned
        from mori_integrations.sglang.bootstrap_auth import AUTH_HEADER, route_codec, sign_route
    except ImportError:
        AUTH_HEADER, route_codec, sign_route = "X-Mori-Route-Auth", None, None
    t0 = time.monotonic()
    proc = SpawnedProcess(_serve, (SECRET, 2), start_timeout=180, call_timeout=30)
    try:
        (port, ident), (other, other_ident) = proc.hello
        secret_codec = route_codec(SECRET) if route_codec else None

        def signed(body: bytes, server: str, codec: Any = secret_codec) -> Dict[str, str]:
            return {AUTH_HEADER: sign_route(codec, server, body)} if codec is not None else {}

        legit = json.dumps(REGISTRATION).encode()
        captured = signed(legit, ident)
        status, _ = _http(port, "PUT", "/route", legit, captured)
        legit_ok = status == 200 and _registered_port(port) == REGISTRATION["rank_port"]
        evil = json.dumps({**REGISTRATION, "rank_ip": "10.6.6.6", "rank_port": 6666}).encode()
        wrong = route_codec("not-the-secret") if route_codec else None
        attempts = {
            "unsigned": [_http(port, "PUT", "/route", evil)[0] for _ in range(20)],
            "another secret": [_http(port, "PUT", "/route", evil, signed(evil, ident, wrong))[0] for _ in range(20)],
            "captured tag, other body": [_http(port, "PUT", "/route", evil, captured)[0] for _ in range(20)],
            "replay to the same server": [_http(port, "PUT", "/route", legit, captured)[0] for _ in range(20)],
        }
        accepted = {k: sum(s == 200 for s in v) for k, v in attempts.items()}
        victim_kept = _registered_port(port) == REGISTRATION["rank_port"]
        # A registration captured on its way to one server, replayed to another with the same secret.
        cross = [_http(other, "PUT", "/route", evil, signed(evil, ident))[0] for _ in range(20)]
        accepted["replay to another server"] = sum(s == 200 for s in cross)
        other_kept = _registered_port(other) is None
        logs = proc.call("logs")
    finally:
        proc.close()
    out.seconds = time.monotonic() - t0
    forged = sum(accepted.values())
    out.figures = {"forged": 100, "accepted": forged, **{f"accepted: {k}": v for k, v in accepted.items()},
                   "registry kept": victim_kept and other_kept, "legitimate registration": "ok" if legit_ok else
                   "FAILED", "log lines": logs["lines"], "tracebacks": logs["tracebacks"]}
    if forged:
        out.failures.append(f"{forged} of 100 forged registrations accepted ({accepted})")
    if not (victim_kept and other_kept):
        out.failures.append("a forged registration changed the registry")
    if not legit_ok:
        out.failures.append("the legitimate (signed) registration failed")
    if logs["tracebacks"]:
        out.failures.append(f"{logs['tracebacks']} tracebacks logged")
    return out
