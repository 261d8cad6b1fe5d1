"""The PD bootstrap server (``MoriKVBootstrapServer`` over SGLang 0.5.23's aiohttp server), over real HTTP.

Issue #29: on main, 600 bad inputs made it log 11,003 lines (511 tracebacks, 224 HTTP 500s),
and anyone who reached it could re-register a prefill rank's address with ``PUT /route``.
Here bad input gets a 4xx and at most one log line per 10 s in total, never a traceback; with
``MORI_IO_AUTH_SECRET`` only a registration signed for this very server is accepted, once.
"""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from typing import Dict, Iterator, Optional, Tuple

import pytest

pytest.importorskip("sglang")

from sglang.srt.disaggregation.common.conn import CommonKVManager  # noqa: E402

from mori_integrations.sglang.bootstrap_auth import (  # noqa: E402
    AUTH_HEADER,
    SignedRouteRegistration,
    route_codec,
    sign_route,
)
from mori_integrations.sglang.bootstrap_server import MoriKVBootstrapServer  # noqa: E402

SECRET = "bootstrap-test-secret"
GOOD = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
        "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
        "rank_ip": "127.0.0.1", "rank_port": 5001, "page_size": 16, "kv_cache_dtype": "auto"}
QUERY = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


def _http(port: int, method: str, path: str, body: Optional[bytes] = None,
          headers: Optional[Dict[str, str]] = None) -> Tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _raw(port: int, data: bytes) -> int:
    """Send raw bytes; the HTTP status of the answer (0 when the server closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        answer = b""
        while len(answer) < 64:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _registered_port(port: int) -> Optional[int]:
    status, body = _http(port, "GET", QUERY)
    return json.loads(body)["rank_port"] if status == 200 else None


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[MoriKVBootstrapServer]:
    monkeypatch.delenv("MORI_IO_AUTH_SECRET", raising=False)
    s = MoriKVBootstrapServer("127.0.0.1", 0)
    yield s
    s.close()


def _bad_inputs(port: int) -> Iterator[Tuple[str, object]]:
    """(what, outcome) of each kind of bad input; outcome is an HTTP status."""
    put = lambda body: _http(port, "PUT", "/route", body)[0]  # noqa: E731
    for i in range(20):
        yield "malformed JSON", put(b'{"attn_tp_size": 1,' + bytes([0xFF, i]))
        yield "JSON array", put(b"[1, 2, 3]")
        yield "missing field", put(json.dumps({k: v for k, v in GOOD.items() if k != "rank_port"}).encode())
        yield "wrong type", put(json.dumps({**GOOD, "rank_port": "5001"}).encode())
        yield "port out of range", put(json.dumps({**GOOD, "rank_port": 70000 + i}).encode())
        yield "rank above size", put(json.dumps({**GOOD, "attn_tp_rank": 2 + i}).encode())
        yield "huge size", put(json.dumps({**GOOD, "attn_tp_size": 1 << 20}).encode())
        yield "invalid UTF-8 query", _raw(port, b"GET /route?prefill_dp_rank=\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n")
        yield "non-integer query", _http(port, "GET", QUERY.replace("=0&prefill_cp", "=zero&prefill_cp"))[0]
        yield "room out of range", _http(port, "POST", "/register_dp_rank",
                                         json.dumps({"bootstrap_room": -1 - i, "dp_rank": 0}).encode())[0]
        yield "rooms not a list", _http(port, "POST", "/query_dp_ranks", b'{"bootstrap_rooms": 7}')[0]
        yield "garbage request line", _raw(port, bytes(range(256))[i:i + 40] + b"\r\n\r\n")
        yield "oversized body", put(b"{" + b" " * (70 << 10) + b"}")


def test_bad_input_gets_4xx_and_a_bounded_log_without_tracebacks(server, caplog: pytest.LogCaptureFixture) -> None:
    port = server.port
    caplog.set_level(logging.DEBUG)
    outcomes = list(_bad_inputs(port))
    assert len(outcomes) == 260
    wrong = [(what, status) for what, status in outcomes if not (isinstance(status, int) and 400 <= status < 500)]
    assert not wrong, f"bad input not answered with a 4xx: {wrong[:10]}"
    records = [r for r in caplog.records if r.levelno >= logging.INFO and "listening" not in r.getMessage()]
    assert not [r for r in records if r.exc_info], "a traceback was logged"
    assert 1 <= len(records) <= 2, [r.getMessage() for r in records]  # one line per 10 s, with the count
    assert server.bad_inputs >= 200
    # ... and it still serves.
    assert _http(port, "PUT", "/route", json.dumps(GOOD).encode())[0] == 200
    assert _registered_port(port) == GOOD["rank_port"]


def test_without_a_secret_it_warns_when_listening_beyond_loopback(monkeypatch, caplog) -> None:
    monkeypatch.delenv("MORI_IO_AUTH_SECRET", raising=False)
    caplog.set_level(logging.WARNING)
    s = MoriKVBootstrapServer("0.0.0.0", 0)
    try:
        assert any("without authentication" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        s.close()


class _Registrar(SignedRouteRegistration, CommonKVManager):
    """The registration path of MoriKVManager (the mixin over SGLang's manager), without a KV pool."""

    _ROUTE_ATTEMPTS = 1

    def __init__(self) -> None:  # noqa: D107 - the registration needs no manager state
        pass


def test_with_a_secret_only_a_registration_signed_for_this_server_is_accepted_once(monkeypatch, caplog) -> None:
    monkeypatch.setenv("MORI_IO_AUTH_SECRET", SECRET)
    caplog.set_level(logging.WARNING)
    server, other = MoriKVBootstrapServer("127.0.0.1", 0), MoriKVBootstrapServer("127.0.0.1", 0)
    try:
        port = server.port
        # The manager's own registration (what a prefill rank sends) goes through.
        _Registrar()._register_topology_row(f"http://127.0.0.1:{port}/route", GOOD)
        assert _registered_port(port) == GOOD["rank_port"]

        evil = json.dumps({**GOOD, "rank_ip": "10.6.6.6", "rank_port": 6666}).encode()
        forged = route_codec("another-secret")
        captured = json.dumps({**GOOD, "rank_port": 5002}).encode()
        captured_tag = sign_route(route_codec(SECRET), server.identity, captured)
        assert _http(port, "PUT", "/route", captured, {AUTH_HEADER: captured_tag})[0] == 200
        assert _registered_port(port) == 5002
        attempts = {
            "no tag": _http(port, "PUT", "/route", evil),
            "tag with another secret": _http(port, "PUT", "/route", evil,
                                             {AUTH_HEADER: sign_route(forged, server.identity, evil)}),
            "captured tag on another body": _http(port, "PUT", "/route", evil, {AUTH_HEADER: captured_tag}),
            "replay of a captured registration": _http(port, "PUT", "/route", captured, {AUTH_HEADER: captured_tag}),
            "not hexadecimal": _http(port, "PUT", "/route", evil, {AUTH_HEADER: "zz" * 40}),
        }
        for what, (status, body) in attempts.items():
            assert status == 401, (what, status, body)
        assert _registered_port(port) == 5002, "a forged registration changed the table"
        # A registration signed for this server is refused by another server with the same secret.
        status, body = _http(other.port, "PUT", "/route", evil, {AUTH_HEADER: sign_route(
            route_codec(SECRET), server.identity, evil)})
        assert status == 401 and b"bad authentication" in body, body
        assert _registered_port(other.port) is None
        assert not [r for r in caplog.records if r.exc_info]
    finally:
        server.close()
        other.close()


def test_with_a_secret_a_registry_that_is_not_ours_gets_the_stock_registration(monkeypatch, caplog) -> None:
    """SGLang's own server (or its Rust registry) cannot check a tag: the manager registers as stock does, and says so."""
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

    monkeypatch.setenv("MORI_IO_AUTH_SECRET", SECRET)
    caplog.set_level(logging.WARNING)
    port = _free_port()
    stock = CommonKVBootstrapServer("127.0.0.1", port)
    try:
        for _ in range(200):  # its thread binds in the background
            if _http_up(port):
                break
        _Registrar()._register_topology_row(f"http://127.0.0.1:{port}/route", GOOD)
        assert _registered_port(port) == GOOD["rank_port"]
        assert any("registering without authentication" in r.getMessage() for r in caplog.records)
    finally:
        stock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_up(port: int) -> bool:
    import time

    try:
        return _http(port, "GET", "/health")[0] == 200
    except OSError:
        time.sleep(0.05)
        return False
