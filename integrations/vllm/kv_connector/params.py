"""``kv_transfer_params`` of a request: what the proxy and the prefill hand to the decode.

The keys are MoRIIO's/NIXL's where they exist (``do_remote_prefill``, ``do_remote_decode``,
``remote_host``, ``remote_handshake_port``, ``remote_notify_port``, ``remote_block_ids``,
``remote_engine_id``, ``remote_dp_rank``, ``remote_tp_size``, ``transfer_id``). Ours:
``transfer_mode`` (``"read"`` / ``"write"``: per-request override of ``read_mode``) and
``remote_instance_id``: the prefill *process* that computed the KV (a nonce its scheduler draws
at start). ``remote_engine_id`` alone does not name a process: a server restarted with a fixed
``kv_transfer_config.engine_id`` keeps it, and its blocks at the old block ids hold other KV.

A request id may also carry the peer's address the way MoRIIO's router writes it
(``___prefill_addr_host:IP,handshake:PORT,notify:PORT___decode_addr_..._<32 hex>``);
it is used when ``remote_host`` is absent.
"""

from __future__ import annotations

import re
from typing import Any, List, Mapping, Optional

from mori_integrations.vllm.kv_connector.metadata import PeerAddress

__all__ = [
    "ParamsError",
    "block_lists",
    "engine_id_of",
    "instance_id_of",
    "mode_of",
    "peer_of",
    "transfer_id_of",
]

_PREFILL_ADDR = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
# vLLM turns X-Request-Id "abc" into "cmpl-abc-0-1a2b3c4d" (completions) / "chatcmpl-abc-1a2b3c4d".
_VLLM_WRAPPED = re.compile(r"^(?:chat)?cmpl-(?P<base>.+?)(?:-\d+)?-[0-9a-f]{8}$")
_MAX_ID = 256


class ParamsError(ValueError):
    """kv_transfer_params that cannot drive a transfer (the request then runs locally)."""


def transfer_id_of(request_id: str, params: Mapping[str, Any]) -> str:
    """The id both servers know a transfer by: ``transfer_id``, else the client's request id."""
    tid = params.get("transfer_id")
    if tid is None:
        m = _VLLM_WRAPPED.match(request_id)
        tid = m.group("base") if m else request_id
    if not isinstance(tid, str) or not 0 < len(tid) <= _MAX_ID:
        raise ParamsError(f"transfer_id must be a non-empty string of at most {_MAX_ID} characters, got {tid!r}")
    return tid


def engine_id_of(params: Mapping[str, Any]) -> Optional[str]:
    """``remote_engine_id``: the vLLM engine that holds the request's KV (None when not given)."""
    value = params.get("remote_engine_id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID:
        raise ParamsError(f"remote_engine_id must be a non-empty string of at most {_MAX_ID} characters, got {value!r}")
    return value


def instance_id_of(params: Mapping[str, Any]) -> Optional[str]:
    """``remote_instance_id``: the prefill process whose blocks ``remote_block_ids`` names (None when not given)."""
    value = params.get("remote_instance_id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID:
        raise ParamsError(
            f"remote_instance_id must be a non-empty string of at most {_MAX_ID} characters, got {value!r}"
        )
    return value


def mode_of(params: Mapping[str, Any], default: str) -> str:
    mode = params.get("transfer_mode", default)
    if mode not in ("read", "write"):
        raise ParamsError(f"transfer_mode must be 'read' or 'write', got {mode!r}")
    return mode


def _port(params: Mapping[str, Any], key: str) -> int:
    value = params.get(key)
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ParamsError(f"{key} must be a port number, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise ParamsError(f"{key} must be in [1, 65535], got {port}")
    return port


def _router_address(request_id: str) -> Optional[Mapping[str, str]]:
    m = _PREFILL_ADDR.search(request_id)
    if m is None:
        return None
    parts = dict(seg.partition(":")[::2] for seg in m.group(1).split(","))
    return {
        "remote_host": parts.get("host", ""),
        "remote_handshake_port": parts.get("handshake", ""),
        "remote_notify_port": parts.get("notify", ""),
    }


def peer_of(request_id: str, params: Mapping[str, Any]) -> PeerAddress:
    """The producer's control-plane address for a decode request."""
    source: Mapping[str, Any] = params
    if not params.get("remote_host"):
        source = _router_address(request_id) or params
    host = source.get("remote_host")
    if not isinstance(host, str) or not host:
        raise ParamsError("remote_host is missing (the proxy must pass the prefill's address)")
    dp = params.get("remote_dp_rank", 0) or 0
    tp = params.get("remote_tp_size", params.get("tp_size", 1)) or 1
    if not isinstance(dp, int) or not isinstance(tp, int) or dp < 0 or tp < 1:
        raise ParamsError(f"remote_dp_rank / remote_tp_size must be ints >= 0 / >= 1, got {dp!r} / {tp!r}")
    return PeerAddress(
        host=host,
        handshake_port=_port(source, "remote_handshake_port"),
        notify_port=_port(source, "remote_notify_port"),
        dp_rank=dp,
        tp_size_hint=tp,
    )


def block_lists(value: Any, num_groups: int) -> List[List[int]]:
    """``remote_block_ids`` as one list per KV cache group (a flat list = one group)."""
    if not isinstance(value, (list, tuple)):
        raise ParamsError(f"remote_block_ids must be a list, got {type(value).__name__}")
    groups = list(value) if value and all(isinstance(g, (list, tuple)) for g in value) else [value]
    if len(groups) != num_groups:
        raise ParamsError(f"remote_block_ids has {len(groups)} KV cache groups, this server has {num_groups}")
    out = []
    for g in groups:
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in g):
            raise ParamsError("remote_block_ids must hold non-negative ints")
        out.append([int(b) for b in g])
    return out
