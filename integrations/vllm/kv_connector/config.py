"""``kv_connector_extra_config`` of :class:`MoriSuiteConnector`.

MoRIIOConnector's keys are accepted with the same names, meanings and defaults, so
switching a deployment is one word (``"kv_connector": "MoriSuiteConnector"``):

``handshake_port`` (6301), ``notify_port`` (61005), ``read_mode`` (false = WRITE),
``backend`` (MoRIIO: ``rdma`` | ``xgmi``; here also ``tcp`` and ``auto``, the default),
``qp_per_transfer`` (1), ``post_batch_size`` (-1), ``num_workers`` (1),
``transfer_timeout`` (30 s), ``defer_timeout`` (60 s), ``recv_abort_timeout`` (120 s),
``host_ip`` (default: this host's outgoing address), ``http_port``, ``proxy_ip``,
``proxy_ping_port``.

Our additions: ``auth_secret`` (IO engine + control plane; default ``MORI_IO_AUTH_SECRET``),
``handshake_timeout`` (10 s), ``handshake_ttl`` (5 s: a cached handshake with a peer
not heard from for longer is redone before it is used again), ``transfer_threads`` (4), ``tcp_num_connections`` (4),
``tcp_op_timeout_ms`` (10000), ``xgmi_proxy_blocks`` (0: the XGMI backend's resident copy kernel
for small transfers, off; see docs/io.md), ``same_host_signals`` (true: peers on one host
signal each other without ZMQ's thread wake-ups: a decode's write requests go to the prefill's
Unix-datagram inbox, ``common.local_inbox``, and a prefill rings the decode's shared-memory
doorbell when its writes completed, ``common.doorbell``; ZMQ messages remain the fallback and
still follow), ``control_spin_ms`` (0, the default: off; how long the control thread polls its
sockets every ~20 us instead of sleeping in the kernel, after a request's KV became ready or a
decode asked for writes. A sleeping thread takes 100-150 us to wake on an idle host, but a polling
Python thread takes the GIL from the worker's other threads every time: measured on 4xH100, it
saved ~30-50 us per WRITE request and cost a READ's plan on the model thread ~100 us),
``lead_layers`` (-1, the default: auto; 0: off; N: the first N layers): a request's transfer over
many layers is planned and submitted in two parts, its lead layers and then the rest, so the copy
of the lead runs while the host plans and submits the rest (auto: a quarter of the layers when
there are at least 8 and the request moves at least 32 MiB; see ``common.segments.lead_units``).

Unknown keys are ignored (other tools keep their own keys in the same dict); every
known key with a bad value raises ``ValueError`` naming the key, the value and the limit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from mori_integrations.common.engine_setup import BACKEND_CHOICES, RdmaTuning
from mori_integrations.common.extra_config import ExtraConfig
from mori_integrations.common.net import resolve_host

__all__ = ["CONNECTOR_NAME", "ConnectorConfig", "rank_port"]

CONNECTOR_NAME = "MoriSuiteConnector"
DEFAULT_HANDSHAKE_PORT = 6301  # MoRIIO's defaults
DEFAULT_NOTIFY_PORT = 61005
MODES = ("write", "read")


def rank_port(base: int, dp_local_rank: int, tp_size: int, tp_rank: int) -> int:
    """A worker's port: ``base + dp_local_rank * tp_size + tp_rank`` (MoRIIO's arithmetic)."""
    port = base + dp_local_rank * tp_size + tp_rank
    if not 1 <= port <= 65535:
        raise ValueError(
            f"{CONNECTOR_NAME}: port {base} + dp {dp_local_rank} * tp_size {tp_size} + tp_rank {tp_rank} = {port} "
            "is outside [1, 65535]; lower handshake_port / notify_port"
        )
    return port


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings (see the module docstring for the keys)."""

    host_ip: str
    handshake_port: int
    notify_port: int
    default_mode: str  # "write" | "read"; a request may override it (kv_transfer_params["transfer_mode"])
    backend: str
    rdma: RdmaTuning
    transfer_timeout_s: float
    defer_timeout_s: float
    recv_abort_timeout_s: float
    handshake_timeout_s: float
    handshake_ttl_s: float
    transfer_threads: int
    auth_secret: str
    tcp_num_connections: int
    tcp_op_timeout_ms: int
    xgmi_proxy_blocks: int
    same_host_signals: bool
    control_spin_ms: int  # 0: off (see the module docstring)
    lead_layers: int  # -1: auto, 0: one call per transfer, N: the first N layers first
    http_port: Optional[int]
    proxy_ip: str
    proxy_ping_port: Optional[int]

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> "ConnectorConfig":
        """Validate a ``kv_connector_extra_config`` dict."""
        cfg = ExtraConfig(CONNECTOR_NAME, extra)
        # MoRIIO honours VLLM_MORIIO_TRANSFER_TIMEOUT_S as the recv_abort_timeout fallback.
        recv_default = float(os.environ.get("VLLM_MORIIO_TRANSFER_TIMEOUT_S", "120") or 120)
        transfer = cfg.get_float("transfer_timeout", 30.0, 0.1, 86400.0)
        recv_abort = cfg.get_float("recv_abort_timeout", recv_default, 0.1, 86400.0)
        if recv_abort <= transfer:
            raise ValueError(
                f"{CONNECTOR_NAME}: recv_abort_timeout ({recv_abort:g} s) must exceed transfer_timeout "
                f"({transfer:g} s): a decode gives up on a request only after every write into it has ended"
            )
        proxy_ip = cfg.get_str("proxy_ip", "") or ""
        ping_port = cfg.get_int("proxy_ping_port", None, 0, 65535) or None
        if proxy_ip and ping_port is None:
            raise cfg.fail("proxy_ping_port", cfg.extra.get("proxy_ping_port"), "set (1-65535) when proxy_ip is set")
        if proxy_ip and cfg.get_int("http_port", None, 1, 65535) is None:
            raise cfg.fail("http_port", None, "set (the server's HTTP port, announced to the proxy) when proxy_ip is set")
        return cls(
            host_ip=resolve_host(cfg.get_str("host_ip", "auto") or "auto"),
            handshake_port=cfg.get_int("handshake_port", DEFAULT_HANDSHAKE_PORT, 1, 65535),
            notify_port=cfg.get_int("notify_port", DEFAULT_NOTIFY_PORT, 1, 65535),
            default_mode="read" if cfg.get_bool("read_mode", False) else "write",
            backend=cfg.get_choice("backend", "auto", BACKEND_CHOICES),
            rdma=RdmaTuning(
                qp_per_transfer=cfg.get_int("qp_per_transfer", 1, 1, 64),
                post_batch_size=cfg.get_int("post_batch_size", -1, -1, 1 << 16),
                num_worker_threads=cfg.get_int("num_workers", 1, -1, 256),
            ),
            transfer_timeout_s=transfer,
            defer_timeout_s=cfg.get_float("defer_timeout", 60.0, 0.1, 86400.0),
            recv_abort_timeout_s=recv_abort,
            handshake_timeout_s=cfg.get_float("handshake_timeout", 10.0, 0.1, 3600.0),
            handshake_ttl_s=cfg.get_float("handshake_ttl", 5.0, 0.0, 86400.0),
            transfer_threads=cfg.get_int("transfer_threads", 4, 1, 64),
            auth_secret=cfg.get_str("auth_secret", "") or os.environ.get("MORI_IO_AUTH_SECRET", ""),
            tcp_num_connections=cfg.get_int("tcp_num_connections", 4, 1, 64),
            tcp_op_timeout_ms=cfg.get_int("tcp_op_timeout_ms", 10000, 10, 3_600_000),
            xgmi_proxy_blocks=cfg.get_int("xgmi_proxy_blocks", 0, 0, 64),
            same_host_signals=cfg.get_bool("same_host_signals", True),
            control_spin_ms=cfg.get_int("control_spin_ms", 0, 0, 60_000),
            lead_layers=cfg.get_int("lead_layers", -1, -1, 1 << 16),
            http_port=cfg.get_int("http_port", None, 1, 65535),
            proxy_ip=proxy_ip,
            proxy_ping_port=ping_port,
        )

    def write_budget_s(self) -> float:
        """How long after a decode asks for writes a prefill may still start one.

        A decode waits ``recv_abort_timeout`` before it frees blocks a prefill may write;
        every write ends within ``transfer_timeout`` of its start, so writes must start
        within the difference.
        """
        return self.recv_abort_timeout_s - self.transfer_timeout_s
