"""Connector settings parsed from a vLLM-Omni connector ``extra`` dict.

The keys of the stock ``MoriTransferEngineConnector`` are accepted unchanged
(``host, zmq_port, role, sender_host, sender_zmq_port, stage_id, from_stage,
to_stage, backend_type, device_name, memory_pool_size, memory_pool_device,
qp_per_transfer, post_batch_size, num_worker_threads, xgmi_num_streams,
xgmi_num_events``) so existing stage YAMLs keep working. Our additions are
documented on :class:`ConnectorSettings`. Unknown keys are ignored on purpose:
vLLM-Omni stores processor knobs (``codec_chunk_frames`` ...) in the same dict.

Every bad value raises ``ValueError`` naming the key, the value and the limit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from mori_integrations.common.extra_config import ExtraConfig
from mori_integrations.common.net import detect_local_ip, resolve_host

__all__ = ["ConnectorSettings", "ROLES", "BACKENDS", "detect_local_ip", "resolve_host"]

ROLES = ("sender", "receiver", "dual")
BACKENDS = ("auto", "tcp", "xgmi", "rdma")
# vLLM-Omni's port stride between TP ranks (utils/initialization.KV_RANK_PORT_STRIDE).
DEFAULT_RANK_PORT_STRIDE = 16
_OWNER = "MoriTransferEngineConnector"


def _get_device(cfg: ExtraConfig) -> str:
    value = cfg.get_str("memory_pool_device", "cpu") or "cpu"
    device = value.strip().lower()
    if device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device):
        return device
    raise cfg.fail("memory_pool_device", value, "'cpu', 'cuda' or 'cuda:<index>'")


@dataclass(frozen=True)
class ConnectorSettings:
    """Validated connector configuration.

    Attributes (our additions to the stock keys are marked *new*):
        host: literal address this connector's listener and IO engine bind.
        role: ``sender`` (listens from the start), ``receiver`` (listens only
            once it is asked to ``put``: a middle stage), or ``dual``.
        listen_port: ZMQ port of this connector's pull listener; None when a
            receiver has no way to derive one (its ``put`` then fails clearly).
        sender_host / sender_zmq_port: default upstream endpoint for ``get``
            calls without metadata.
        tp_rank (*new*): when given, every port is offset by
            ``tp_rank * rank_port_stride`` (vLLM-Omni 0.30 already applies
            this stride to the ports it injects; set it only for connectors
            built outside that wiring).
        outgoing_zmq_port (*new*): explicit listener port for a receiver that
            also sends. Without it the port is derived the way vLLM-Omni
            derives the downstream stage's ``sender_zmq_port``.
        num_pull_workers (*new*): threads serving pull requests (default 4).
        query_timeout_s / transfer_timeout_s / transfer_timeout_per_100mb_s
            (*new*): bounds of the control round trip and of one pull.
        buffer_ttl_seconds: unclaimed sender buffers are reclaimed after this
            long — never while a transfer reads them.
        auth_secret (*new*): shared secret of the IO engine and of the control plane (every
            control message signed, fresh, not replayed); default ``MORI_IO_AUTH_SECRET``.
        tcp_num_connections / tcp_op_timeout_ms / tcp_heartbeat_timeout_ms (*new*): TCP backend
            knobs (the heartbeat fails writes to a stopped receiver; 0 turns it off).
    """

    host: str
    role: str
    listen_port: Optional[int]
    sender_host: Optional[str]
    sender_zmq_port: Optional[int]
    stage_id: int
    from_stage: Optional[int]
    to_stage: Optional[int]
    backend_type: str
    device_name: str
    memory_pool_size: int
    memory_pool_device: str
    buffer_ttl_seconds: float
    num_pull_workers: int
    query_timeout_s: float
    transfer_timeout_s: float
    transfer_timeout_per_100mb_s: float
    tp_rank: int
    rank_port_stride: int
    auth_secret: str
    tcp_num_connections: int
    tcp_op_timeout_ms: int
    tcp_heartbeat_timeout_ms: int
    xgmi_num_streams: int
    xgmi_num_events: int
    qp_per_transfer: int
    post_batch_size: int
    num_worker_threads: int

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> "ConnectorSettings":
        """Validate a connector ``extra`` dict (see the module docstring)."""
        cfg = ExtraConfig(_OWNER, extra)
        extra = cfg.extra

        role = (cfg.get_str("role", "sender") or "sender").strip().lower()
        if role not in ROLES:
            raise cfg.fail("role", extra.get("role"), f"one of {list(ROLES)}")
        backend = (cfg.get_str("backend_type", "auto") or "auto").strip().lower()
        if backend not in BACKENDS:
            raise cfg.fail("backend_type", extra.get("backend_type"), f"one of {list(BACKENDS)}")
        device = _get_device(cfg)
        if backend == "xgmi" and device == "cpu":
            raise ValueError(
                "MoriTransferEngineConnector: backend_type 'xgmi' copies GPU to GPU and needs "
                "memory_pool_device 'cuda' (got 'cpu'); use backend_type 'tcp' or 'auto' for a CPU pool"
            )

        tp_rank = cfg.get_int("tp_rank", 0, 0, 1023)
        stride = cfg.get_int("rank_port_stride", DEFAULT_RANK_PORT_STRIDE, 1, 4096)
        rank_offset = tp_rank * stride
        stage_id = cfg.get_int("stage_id", -1, -1, 1 << 20)
        from_stage = cfg.get_int("from_stage", None, 0, 1 << 20)
        to_stage = cfg.get_int("to_stage", None, 0, 1 << 20)

        zmq_port = cfg.get_int("zmq_port", None, 1, 65535)
        sender_port = cfg.get_int("sender_zmq_port", None, 1, 65535)
        outgoing_port = cfg.get_int("outgoing_zmq_port", None, 1, 65535)
        if sender_port is not None:
            sender_port += rank_offset
        listen_port = _listen_port(role, zmq_port, outgoing_port, sender_port, from_stage, stage_id, rank_offset)
        for name, port in (("listen port", listen_port), ("sender_zmq_port", sender_port)):
            if port is not None and not 1 <= port <= 65535:
                raise ValueError(
                    f"MoriTransferEngineConnector: {name} resolves to {port}, outside [1, 65535] "
                    f"(tp_rank*rank_port_stride = {rank_offset}, stage_id = {stage_id})"
                )

        sender_host = cfg.get_str("sender_host", None)
        return cls(
            host=resolve_host(cfg.get_str("host", "127.0.0.1") or ""),
            role=role,
            listen_port=listen_port,
            sender_host=resolve_host(sender_host) if sender_host is not None else None,
            sender_zmq_port=sender_port,
            stage_id=stage_id,
            from_stage=from_stage,
            to_stage=to_stage,
            backend_type=backend,
            device_name=cfg.get_str("device_name", "") or "",
            memory_pool_size=cfg.get_size("memory_pool_size", 1 << 30, 1 << 16, 1 << 40),
            memory_pool_device=device,
            buffer_ttl_seconds=cfg.get_float("buffer_ttl_seconds", 300.0, 0.01, 7 * 86400.0),
            num_pull_workers=cfg.get_int("num_pull_workers", 4, 1, 256),
            query_timeout_s=cfg.get_float("query_timeout_s", 5.0, 0.01, 3600.0),
            transfer_timeout_s=cfg.get_float("transfer_timeout_s", 30.0, 0.01, 3600.0),
            transfer_timeout_per_100mb_s=cfg.get_float("transfer_timeout_per_100mb_s", 5.0, 0.0, 3600.0),
            tp_rank=tp_rank,
            rank_port_stride=stride,
            auth_secret=cfg.get_str("auth_secret", "") or os.environ.get("MORI_IO_AUTH_SECRET", ""),
            tcp_num_connections=cfg.get_int("tcp_num_connections", 4, 1, 64),
            tcp_op_timeout_ms=cfg.get_int("tcp_op_timeout_ms", 10000, 10, 3_600_000),
            tcp_heartbeat_timeout_ms=_heartbeat(cfg),
            xgmi_num_streams=cfg.get_int("xgmi_num_streams", 64, 1, 1024),
            xgmi_num_events=cfg.get_int("xgmi_num_events", 64, 1, 1024),
            qp_per_transfer=cfg.get_int("qp_per_transfer", 1, 1, 64),
            post_batch_size=cfg.get_int("post_batch_size", -1, -1, 1 << 16),
            num_worker_threads=cfg.get_int("num_worker_threads", 1, -1, 256),
        )

    def transfer_timeout_for(self, nbytes: int) -> float:
        """Bound of one pull of ``nbytes``: base + a share per started 100 MB."""
        return self.transfer_timeout_s + (nbytes // (100 * 1000 * 1000)) * self.transfer_timeout_per_100mb_s


def _heartbeat(cfg: ExtraConfig) -> int:
    value = cfg.get_int("tcp_heartbeat_timeout_ms", 1500, 0, 3_600_000)
    if 0 < value < 100:
        raise cfg.fail("tcp_heartbeat_timeout_ms", value, "0 (off) or >= 100")
    return value


def _listen_port(
    role: str,
    zmq_port: Optional[int],
    outgoing_port: Optional[int],
    sender_port: Optional[int],
    from_stage: Optional[int],
    stage_id: int,
    rank_offset: int,
) -> Optional[int]:
    """Where this connector's pull listener binds (None: nowhere known yet).

    vLLM-Omni 0.30 gives a downstream receiver ``sender_zmq_port = base +
    rank/replica offsets + from_stage`` and strips ``zmq_port`` from receiver
    specs. A middle stage (receiver of edge k-1 -> k that also sends on
    k -> k+1) therefore listens on ``sender_zmq_port - from_stage + stage_id``:
    exactly the port its own downstream stage computes for it.
    """
    if role in ("sender", "dual") and zmq_port is not None:
        return zmq_port + rank_offset
    if outgoing_port is not None:
        return outgoing_port + rank_offset
    if sender_port is not None and from_stage is not None and stage_id >= 0:
        return sender_port - from_stage + stage_id
    if role == "sender":
        return 50051 + rank_offset  # the stock connector's default port
    return None
