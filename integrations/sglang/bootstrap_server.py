"""``MoriKVBootstrapServer``: the prefill's rank registry (SGLang's aiohttp server), hardened.

Adds to ``CommonKVBootstrapServer`` (sglang 0.5.23):

* it waits (bounded) until the listener is up and raises if it could not bind, instead of
  logging from its thread while the server silently never serves; ``port=0`` binds an
  OS-chosen port, published as :attr:`port` (tests and several PD pairs on one host);
* with a shared secret (``MORI_IO_AUTH_SECRET``) ``PUT /route`` must carry a valid
  ``X-Mori-Route-Auth`` tag over its body and this server's identity
  (:mod:`.bootstrap_auth`); a forged, replayed or foreign registration gets 401 and
  changes nothing. Without a secret it warns at start when it listens beyond loopback,
  like the other listeners;
* every request body and query is validated before SGLang's handler sees it (types, ranges,
  sizes, ranks below the registered sizes, a bounded room table): bad input gets a 4xx
  naming what is wrong, never a 500 or a traceback;
* what it logs about bad input -- its own refusals and aiohttp's malformed-HTTP errors --
  is one line without traceback, at most one per 10 s in total over all peers, each
  saying how many similar events were suppressed since the previous line.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Annotated, Any, Awaitable, Callable, Dict, List, Optional

import msgspec
from aiohttp import web
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from mori_integrations.common.log_limit import RateLimitedLog, warn_if_exposed
from mori_integrations.sglang.bootstrap_auth import (
    AUTH_HEADER,
    IDENTITY_PATH,
    MAX_ROUTE_BODY,
    RouteAuthError,
    auth_secret,
    route_codec,
    verify_route,
)

__all__ = ["MAX_RANKS", "MAX_ROOMS", "MoriKVBootstrapServer"]

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 30.0
LOG_INTERVAL_S = 10.0
MAX_RANKS = 4096  # per parallel dimension (DP, CP, TP, PP)
MAX_TOTAL_RANKS = 1 << 16  # prefill ranks one server registers (dp * cp * tp * pp)
MAX_ROOMS = 1 << 20  # room -> DP rank entries held between cleanups
MAX_QUERY_ROOMS = 1 << 16
MAX_SMALL_BODY = 4 << 20  # /query_dp_ranks with MAX_QUERY_ROOMS rooms fits
_LOG_SOURCE = "all peers"  # one budget for everyone: bounded in total, not per address

Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Short = Annotated[str, msgspec.Meta(max_length=256)]
Room = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # SGLang draws rooms from [0, 2**63)


class _Registration(msgspec.Struct):
    """The fields of SGLang 0.5.23's ``PUT /route`` body its handler reads (others are allowed)."""

    attn_tp_size: Size
    attn_tp_rank: Rank
    attn_cp_size: Size
    attn_cp_rank: Rank
    attn_dp_size: Size
    attn_dp_rank: Rank
    pp_size: Size
    pp_rank: Rank
    system_dp_size: Size
    system_dp_rank: Rank
    rank_ip: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    rank_port: Port
    page_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    kv_cache_dtype: Optional[Short]
    kv_layout: Optional[Short] = None
    prefill_http_port: Optional[Port] = None
    dsv41_spec_layout: Optional[Dict[str, Any]] = None
    load_balance_method: Short = "follow_bootstrap_room"
    enable_dsa_cache_layer_split: bool = False
    enable_kv_cache_sharding: bool = False
    decode_allocation_policy: Short = "early"


class _DpRank(msgspec.Struct):
    bootstrap_room: Room
    dp_rank: Rank


class _DpQuery(msgspec.Struct):
    bootstrap_rooms: Annotated[List[Room], msgspec.Meta(max_length=MAX_QUERY_ROOMS)]


class _Refused(Exception):
    """Bad input: answered with ``status`` and ``reason``, logged (bounded) as one line."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _HttpErrorLog:
    """What aiohttp's request handler logs malformed HTTP to: one bounded line, no traceback.

    aiohttp logs every unparsable request with ``logger.exception`` (a traceback each); a
    peer that sends garbage would otherwise write as much to the log as it likes.
    """

    def __init__(self, bad_input: RateLimitedLog) -> None:
        self._bad_input = bad_input

    def exception(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        what = f"{type(exc_info).__name__}: {_one_line(str(exc_info))}" if isinstance(exc_info, BaseException) else ""
        self._bad_input.warning(_LOG_SOURCE, "PD bootstrap server: %s (%s)", _one_line(_safe(msg, args)),
                                what or "no detail")

    error = warning = exception

    def debug(self, msg: str, *args: Any, **_: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("PD bootstrap server (aiohttp): %s", _one_line(_safe(msg, args)))

    info = debug


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line (aiohttp's parse errors span several), at most ``limit`` characters."""
    return " ".join(text.split())[:limit]


def _safe(msg: str, args: tuple) -> str:
    try:
        return (msg % args) if args else str(msg)
    except (TypeError, ValueError):
        return str(msg)


class MoriKVBootstrapServer(CommonKVBootstrapServer):
    """Bootstrap server that reports the port it bound, authenticates and validates (see the module docstring)."""

    def __init__(self, host: str, port: int) -> None:
        self._runner = None
        self._loop = None
        secret = auth_secret()
        self._route_codec = route_codec(secret) if secret else None
        self.identity = uuid.uuid4().hex  # what a registration's tag is bound to (see bootstrap_auth)
        self._bad_input = RateLimitedLog(logger, LOG_INTERVAL_S)
        self.bad_inputs = 0  # every refused request (logged or not)
        super().__init__(host, port)
        self.port = self._wait_bound_port(host, port)
        warn_if_exposed(logger, f"SGLang PD bootstrap server on port {self.port}", host, secret != "")

    # ------------------------------------------------------------- start-up
    def _wait_bound_port(self, host: str, port: int) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            runner = self._runner
            addresses = list(getattr(runner, "addresses", None) or []) if runner is not None else []
            if addresses:
                return int(addresses[0][1])
            if not self.thread.is_alive():
                break
            time.sleep(0.01)
        raise RuntimeError(
            f"PD bootstrap server could not listen on {host}:{port} (port in use? use a distinct "
            "--disaggregation-bootstrap-port per PD pair on one host)"
        )

    def _setup_routes(self) -> None:
        super()._setup_routes()
        self.app.router.add_get(IDENTITY_PATH, self._handle_identity)

        @web.middleware
        async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                        ) -> web.StreamResponse:
            return await self._guarded(request, handler)

        self.app.middlewares.append(guard)

    def _run_server(self) -> None:
        """SGLang's ``_run_server`` with aiohttp's error log bounded (see :class:`_HttpErrorLog`)."""
        try:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            cleanup_task = self._loop.create_task(self._cleanup_expired_entries())
            self._background_tasks.add(cleanup_task)
            cleanup_task.add_done_callback(self._background_tasks.discard)
            access_log = self.app.logger if logger.isEnabledFor(logging.DEBUG) else None
            self._runner = web.AppRunner(self.app, access_log=access_log, logger=_HttpErrorLog(self._bad_input))
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host=self.host, port=self.port)
            self._loop.run_until_complete(site.start())
            bound = list(getattr(self._runner, "addresses", None) or [(self.host, self.port)])[0]
            logger.info("PD bootstrap server listening on %s:%s%s", self.host, bound[1],
                        " (registrations authenticated)" if self._route_codec is not None else "")
            self._loop.run_forever()
        except Exception as e:  # the constructor reports a server that never listened
            logger.error("PD bootstrap server on %s:%s stopped: %s: %s", self.host, self.port, type(e).__name__, e)
        finally:
            if self._runner is not None:
                self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

    # ------------------------------------------------------------- requests
    async def _handle_identity(self, request: web.Request) -> web.Response:
        return web.json_response({"server": self.identity, "authenticated": self._route_codec is not None})

    async def _guarded(self, request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            await self._check(request)
            return await handler(request)
        except web.HTTPException:
            raise  # the router's own answers (404, 405, 413): not an error of ours
        except _Refused as e:
            self.bad_inputs += 1
            self._bad_input.warning(_LOG_SOURCE, "PD bootstrap server refused %s %s from %s: %s", request.method,
                                    _one_line(request.path, 64), request.remote, e.reason)
            return web.Response(status=e.status, text=e.reason)
        except Exception as e:  # SGLang's handler failed on input we accepted: say so once, no traceback
            self.bad_inputs += 1
            self._bad_input.warning(_LOG_SOURCE, "PD bootstrap server: %s %s from %s failed: %s: %s", request.method,
                                    _one_line(request.path, 64), request.remote, type(e).__name__,
                                    _one_line(str(e)))
            return web.Response(status=500, text=f"{type(e).__name__}: {_one_line(str(e))}")

    async def _check(self, request: web.Request) -> None:
        """Validate (and with a secret authenticate) a request before SGLang's handler runs."""
        path, method = request.path, request.method
        if path == "/route" and method == "PUT":
            body = await _body(request, MAX_ROUTE_BODY)
            if self._route_codec is not None:
                try:
                    verify_route(self._route_codec, self.identity, body, request.headers.get(AUTH_HEADER, ""))
                except RouteAuthError as e:
                    raise _Refused(401, str(e)) from None
            self._check_registration(_decode(body, _Registration))
        elif path == "/route" and method == "GET":
            for key in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"):
                value = request.query.get(key)
                if value is None:
                    continue  # SGLang answers a missing input with 400 itself
                try:
                    number = int(value)
                except ValueError:
                    raise _Refused(400, f"{key} must be an integer, got {value[:32]!r}") from None
                if not -1 <= number < MAX_RANKS:
                    raise _Refused(400, f"{key} must be in [-1, {MAX_RANKS}), got {number}")
        elif path == "/register_dp_rank" and method == "POST":
            _decode(await _body(request, MAX_SMALL_BODY), _DpRank)
            if len(self.room_to_dp_rank) >= MAX_ROOMS:
                raise _Refused(503, f"room table full ({MAX_ROOMS} entries until the next cleanup)")
        elif path == "/query_dp_ranks" and method == "POST":
            _decode(await _body(request, MAX_SMALL_BODY), _DpQuery)

    def _check_registration(self, reg: _Registration) -> None:
        """Ranks below their sizes, sizes equal to those already registered, the table bounded."""
        dp_size = reg.attn_dp_size if reg.system_dp_size == 1 else reg.system_dp_size
        dp_rank = reg.attn_dp_rank if reg.system_dp_size == 1 else reg.system_dp_rank
        dims = [
            ("attn_tp", self.attn_tp_size, reg.attn_tp_size, reg.attn_tp_rank),
            ("attn_cp", self.attn_cp_size, reg.attn_cp_size, reg.attn_cp_rank),
            ("dp", self.dp_size, dp_size, dp_rank),
            ("pp", self.pp_size, reg.pp_size, reg.pp_rank),
        ]
        total = 1
        for name, registered, size, rank in dims:
            if registered is not None and size != registered:
                raise _Refused(400, f"{name}_size {size} differs from the {registered} registered before")
            if rank >= size:
                raise _Refused(400, f"{name} rank {rank} is not below {name}_size {size}")
            total *= size
        if total > MAX_TOTAL_RANKS:
            raise _Refused(400, f"dp * cp * tp * pp = {total} prefill ranks exceeds {MAX_TOTAL_RANKS}")


async def _body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise _Refused(413, f"body of {request.content_length} bytes exceeds {limit}")
    body = await request.read()
    if len(body) > limit:
        raise _Refused(413, f"body of {len(body)} bytes exceeds {limit}")
    return body


def _decode(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise _Refused(400, f"invalid JSON body: {_one_line(str(e))}") from None
