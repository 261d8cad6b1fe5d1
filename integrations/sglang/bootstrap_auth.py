"""Authenticated prefill registration (``PUT /route``) with SGLang's PD bootstrap server.

SGLang's bootstrap server maps each prefill rank to the address decodes send their KV
requests to; whoever can ``PUT /route`` can point a rank at another address. With a shared
secret (``MORI_IO_AUTH_SECRET``, the IO engine's) the registration carries an
``X-Mori-Route-Auth`` header: the tag of the shared control codec
(:class:`~mori_integrations.common.control_codec.ControlCodec`: HMAC-SHA256 with a fresh
nonce and the send time, refused when older than 2 minutes or replayed) over the exact JSON
body *and* the bootstrap server's identity, a random token each server draws at start and
serves at :data:`IDENTITY_PATH`. A registration captured on the wire is therefore refused by
the same server (replayed nonce), by another bootstrap server with the same secret and by the
same server after a restart (other identity). The body is SGLang's JSON, unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Annotated, Any, Dict

import msgspec

from mori_integrations.common.control_codec import ControlCodec, ControlMessageError

__all__ = [
    "AUTH_HEADER",
    "IDENTITY_PATH",
    "MAX_ROUTE_BODY",
    "RouteAuthError",
    "SignedRouteRegistration",
    "auth_secret",
    "route_codec",
    "sign_route",
    "verify_route",
]

logger = logging.getLogger(__name__)

AUTH_HEADER = "X-Mori-Route-Auth"
IDENTITY_PATH = "/mori_suite/identity"
MAX_ROUTE_BODY = 64 << 10  # SGLang's registration JSON is < 1 KiB (more with a DSpark layout)
_GUARD = b"MoriSuiteSglBoot1"
_KIND = b"ROUTE"
_MAX_TAG_HEX = 512


class RouteAuthError(ValueError):
    """A ``PUT /route`` whose authentication is missing, malformed, forged, stale or replayed."""


class _RouteAuth(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the tag covers: the server it is addressed to and the exact HTTP body."""

    server: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    body: Annotated[bytes, msgspec.Meta(max_length=MAX_ROUTE_BODY)]


def auth_secret() -> str:
    """The deployment's shared secret (``MORI_IO_AUTH_SECRET``); "" = none."""
    return os.environ.get("MORI_IO_AUTH_SECRET", "")


def route_codec(secret: str) -> ControlCodec:
    """The codec whose tag authenticates registrations (one per server: it remembers nonces)."""
    return ControlCodec(_GUARD, {_KIND: (_RouteAuth, MAX_ROUTE_BODY + 512)}, secret.encode())


def sign_route(codec: ControlCodec, server: str, body: bytes) -> str:
    """The :data:`AUTH_HEADER` value for ``body`` sent to the bootstrap server named ``server``."""
    frames = codec.encode(_RouteAuth(server=server, body=body))
    return frames[3].hex()


def verify_route(codec: ControlCodec, server: str, body: bytes, header: str) -> None:
    """Raise :class:`RouteAuthError` unless ``header`` authenticates ``body`` for this ``server``."""
    if not header:
        raise RouteAuthError(f"PUT /route without {AUTH_HEADER} (this bootstrap server has a shared secret)")
    if len(header) > _MAX_TAG_HEX:
        raise RouteAuthError(f"{AUTH_HEADER} of {len(header)} characters (at most {_MAX_TAG_HEX})")
    try:
        tag = bytes.fromhex(header)
    except ValueError:
        raise RouteAuthError(f"{AUTH_HEADER} is not hexadecimal") from None
    frames = [_GUARD, _KIND, msgspec.msgpack.encode(_RouteAuth(server=server, body=body)), tag]
    try:
        codec.decode(frames)
    except ControlMessageError as e:
        raise RouteAuthError(f"PUT /route refused: {e}") from None


class SignedRouteRegistration:
    """Mixin for SGLang's ``CommonKVManager``: sign ``PUT /route`` when a shared secret is set.

    Replaces ``_register_topology_row`` (SGLang 0.5.23: five attempts with backoff) by the same
    loop that first asks the server for its identity and sends the body with the header.
    Without a secret SGLang's own method runs unchanged.
    """

    _ROUTE_ATTEMPTS = 5

    def _register_topology_row(self, url: str, payload: Dict[str, Any]) -> None:
        secret = auth_secret()
        if not secret:
            super()._register_topology_row(url, payload)  # type: ignore[misc]
            return
        import requests

        codec = route_codec(secret)
        body = json.dumps(payload).encode()
        base = url[: -len("/route")] if url.endswith("/route") else url
        for attempt in range(self._ROUTE_ATTEMPTS):
            try:
                ident = requests.get(base + IDENTITY_PATH, timeout=5)
                if ident.status_code == 404:  # not our server (e.g. SGLang's Rust registry): it cannot check a tag
                    logger.warning("the bootstrap registry at %s is not mori-suite's (no %s): registering without "
                                   "authentication", base, IDENTITY_PATH)
                    super()._register_topology_row(url, payload)  # type: ignore[misc]
                    return
                if ident.status_code != 200:
                    raise RuntimeError(f"{IDENTITY_PATH} answered {ident.status_code} (is the bootstrap server "
                                       "mori-suite's, with the same MORI_IO_AUTH_SECRET?)")
                headers = {"Content-Type": "application/json",
                           AUTH_HEADER: sign_route(codec, str(ident.json()["server"]), body)}
                response = requests.put(url, data=body, headers=headers, timeout=5)
                if response.status_code == 200:
                    logger.debug("prefill registered with the bootstrap server (authenticated)")
                    return
                reason = f"status {response.status_code}: {response.text[:200]}"
            except Exception as e:  # connection refused while the server starts, bad answers
                reason = f"{type(e).__name__}: {str(e)[:200]}"
            logger.warning("authenticated prefill registration attempt %d/%d failed: %s", attempt + 1,
                           self._ROUTE_ATTEMPTS, reason)
            if attempt + 1 < self._ROUTE_ATTEMPTS:
                time.sleep(min(2.0**attempt, 30.0))
        logger.error("prefill could not register with the bootstrap server at %s after %d attempts", url,
                     self._ROUTE_ATTEMPTS)
