"""A small prefill/decode proxy for ``MoriSuiteConnector`` (like vLLM's disaggregated-serving example).

    python -m mori_integrations.vllm.pd_proxy --prefill http://10.0.0.1:8100 \\
        --decode http://10.0.0.2:8200 --port 8000 [--mode write|read]

For each ``/v1/completions`` or ``/v1/chat/completions`` request it picks a prefill and a
decode server (round robin) and

* ``read``: sends the request to the prefill with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": true, ...}``, then sends the original
  request to the decode with the ``kv_transfer_params`` the prefill returned (its block
  ids and address); the decode pulls the KV.
* ``write`` (default, like MoRIIO's WRITE mode): sends both at once; the decode tells
  the prefill where its blocks are and the prefill writes the KV layer by layer while it
  computes. If the prefill leg fails, the decode leg is cancelled (the decode server
  aborts the request and frees its blocks) and the client gets HTTP 502.

The decode's response (streamed or not) is returned to the client unchanged. Both legs
carry the same ``X-Request-Id`` and ``transfer_id``. A toy: no retries, no health-based
routing. Uses only aiohttp (installed with vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence
from urllib.parse import urlparse

import aiohttp
from aiohttp import web

__all__ = ["Backend", "build_app", "main"]

logger = logging.getLogger("mori_integrations.vllm.pd_proxy")


@dataclass(frozen=True)
class Backend:
    """One vLLM server (and, for a prefill, where its connector's control plane listens)."""

    url: str
    kv_host: str
    handshake_port: int
    notify_port: int


def _backends(urls: Sequence[str], ports: Sequence[str]) -> List[Backend]:
    if ports and len(ports) not in (1, len(urls)):
        raise SystemExit(f"--prefill-ports: give one HANDSHAKE:NOTIFY pair or one per --prefill ({len(urls)})")
    out = []
    for i, url in enumerate(urls):
        spec = ports[i if len(ports) > 1 else 0] if ports else "6301:61005"  # MoRIIO's default ports
        try:
            handshake, notify = (int(p) for p in spec.split(":"))
        except ValueError:
            raise SystemExit(f"--prefill-ports: expected HANDSHAKE:NOTIFY, got {spec!r}") from None
        host = urlparse(url).hostname
        if not host:
            raise SystemExit(f"not a URL: {url!r}")
        out.append(Backend(url.rstrip("/"), host, handshake, notify))
    return out


class PDProxy:
    """Routes requests over prefill and decode backends (see the module docstring)."""

    def __init__(self, prefill: List[Backend], decode: List[Backend], mode: str, timeout_s: float) -> None:
        self.mode = mode
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._decode_list = decode
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: Optional[aiohttp.ClientSession] = None

    async def start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)

    async def stop(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _prefill_body(self, body: Dict[str, Any], transfer_id: str) -> Dict[str, Any]:
        p = copy.deepcopy(body)
        p["max_tokens"] = 1
        if "max_completion_tokens" in p:
            p["max_completion_tokens"] = 1
        p["stream"] = False
        p.pop("stream_options", None)
        p["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
            "transfer_mode": self.mode,
        }
        return p

    async def _post_json(self, url: str, body: Dict[str, Any], headers: Dict[str, str]) -> Dict[str, Any]:
        assert self._session is not None
        async with self._session.post(url, json=body, headers=headers) as resp:
            text = await resp.text()
        if resp.status != 200:
            raise web.HTTPBadGateway(text=f"prefill {url} answered {resp.status}: {text[:2000]}")
        try:
            return json.loads(text)
        except ValueError:
            raise web.HTTPBadGateway(text=f"prefill {url} answered with non-JSON: {text[:200]!r}") from None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        path = request.path
        prefill, decode = next(self._prefill), next(self._decode)
        transfer_id = uuid.uuid4().hex
        headers = {"X-Request-Id": transfer_id}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        d_body = copy.deepcopy(body)
        d_body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "transfer_mode": self.mode,
            "remote_host": prefill.kv_host,
            "remote_handshake_port": prefill.handshake_port,
            "remote_notify_port": prefill.notify_port,
        }
        prefill_leg = asyncio.ensure_future(self._post_json(prefill.url + path, self._prefill_body(body, transfer_id), headers))
        if self.mode == "read":
            try:
                answer = await prefill_leg
            except web.HTTPException:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise web.HTTPBadGateway(text=f"prefill {prefill.url} failed: {e!r}") from None
            params = answer.get("kv_transfer_params")
            if not params:
                raise web.HTTPBadGateway(
                    text="the prefill returned no kv_transfer_params (is it running MoriSuiteConnector as kv_producer?)"
                )
            d_body["kv_transfer_params"].update(params)
            d_body["kv_transfer_params"]["do_remote_prefill"] = True
            d_body["kv_transfer_params"]["do_remote_decode"] = False
            return await self._relay(request, decode.url + path, d_body, headers, None)
        return await self._relay(request, decode.url + path, d_body, headers, prefill_leg)

    async def _relay(
        self,
        request: web.Request,
        url: str,
        body: Dict[str, Any],
        headers: Dict[str, str],
        prefill_leg: Optional["asyncio.Future[Dict[str, Any]]"],
    ) -> web.StreamResponse:
        """Send the decode leg; with a concurrent prefill leg, cancel the decode if the prefill fails."""
        assert self._session is not None
        decode_leg = asyncio.ensure_future(self._session.post(url, json=body, headers=headers))
        if prefill_leg is not None:
            try:
                await prefill_leg
            except BaseException as e:
                decode_leg.cancel()  # closes the connection: vLLM aborts the request and frees its blocks
                if decode_leg.done() and not decode_leg.cancelled() and decode_leg.exception() is None:
                    decode_leg.result().close()
                if isinstance(e, web.HTTPException):
                    raise
                raise web.HTTPBadGateway(text=f"prefill failed: {e!r}") from None
        try:
            upstream = await decode_leg
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise web.HTTPBadGateway(text=f"decode {url} failed: {e!r}") from None
        try:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            upstream.release()

    async def models(self, _request: web.Request) -> web.Response:
        assert self._session is not None
        async with self._session.get(self._decode_list[0].url + "/v1/models") as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")


def build_app(prefill: List[Backend], decode: List[Backend], mode: str = "write", timeout_s: float = 600.0) -> web.Application:
    """The proxy as an aiohttp application (for embedding and tests)."""
    proxy = PDProxy(prefill, decode, mode, timeout_s)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    return app


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mori_integrations.vllm.pd_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="prefill server URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="decode server URL (repeatable)")
    parser.add_argument(
        "--prefill-ports",
        action="append",
        default=[],
        help="HANDSHAKE:NOTIFY base ports of the prefill's connector (one, or one per --prefill; default 6301:61005)",
    )
    parser.add_argument("--mode", choices=("write", "read"), default="write")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per leg")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    prefill = _backends(args.prefill, args.prefill_ports)
    decode = _backends(args.decode, [])
    logger.info("pd_proxy: %s mode, prefill %s, decode %s", args.mode, [b.url for b in prefill], [b.url for b in decode])
    web.run_app(build_app(prefill, decode, args.mode, args.timeout), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
