"""``MoriTransferEngineConnector`` for vLLM-Omni 0.30, on mori-suite's IO engine.

Translates vLLM-Omni's connector API (``put`` / ``get`` / ``get_with_deadline``
/ ``abandon_get`` / ``reap_consumed`` / ``cleanup`` / ``health`` / ``close``)
into :class:`~.transport.OmniTransport` calls. Differences from the stock
connector of vLLM-Omni 0.24–0.30 (research/vllm_omni.md §8):

* runs wherever mori-suite's core runs (TCP everywhere, XGMI between GPUs of a
  node, RDMA when built), not only on AMD GPUs with ``amd-mori``;
* ``get`` with metadata that carries only ``source_host``/``source_port``
  queries that sender for the size (the stock connector skipped such gets);
* ``get_with_deadline`` / ``abandon_get`` / ``reap_consumed`` are implemented;
* TTL cleanup and explicit ``cleanup`` never free a buffer a transfer reads;
* a ``receiver`` (a middle stage) can also ``put``: it starts listening on
  the port its downstream stage derives for it;
* ports can be offset per TP rank (``tp_rank``), busy ports fail at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from vllm_omni.distributed.omni_connectors.connectors.base import OmniConnectorBase

from .core_import import load_core
from .outbox import KeyBusyError
from .pool import PoolBuffer
from .settings import ConnectorSettings, resolve_host

__all__ = ["MoriTransferEngineConnector"]

logger = logging.getLogger(__name__)

_RAW_TYPES = (bytes, bytearray, memoryview)


class MoriTransferEngineConnector(OmniConnectorBase):
    """OmniConnector whose data plane is mori-suite's IO engine.

    Args:
        config: the connector ``extra`` dict of the stage YAML, with the keys
            vLLM-Omni injects (``role``, ``zmq_port`` / ``sender_zmq_port``,
            ``stage_id``, ``from_stage``, ``to_stage``). See
            :class:`~.settings.ConnectorSettings` for every key.

    ``put`` of a ``torch.Tensor`` or bytes-like object takes the fast path
    (raw bytes; the receiver's ``get`` returns a pool buffer the caller must
    ``release()``); anything else is serialised with vLLM-Omni's
    ``OmniSerializer`` and ``get`` returns the object.
    """

    supports_raw_data: bool = True

    def __init__(self, config: dict[str, Any]) -> None:
        self._closed = True  # until fully built: close() from __del__ is then a no-op
        load_core()  # fail here, clearly, when the compiled core is missing
        from .transport import OmniTransport  # noqa: PLC0415 (needs the core)

        self.config = config
        self.settings = ConnectorSettings.from_extra(config)
        self.stage_id = self.settings.stage_id
        self.role = self.settings.role
        self.host = self.settings.host
        self.sender_host: Optional[str] = self.settings.sender_host
        self.sender_zmq_port: Optional[int] = self.settings.sender_zmq_port
        self._lock = threading.Lock()
        self._transport = OmniTransport(self.settings, name="omni")
        self._closed = False
        logger.info(
            "MoriTransferEngineConnector (mori-suite) stage=%s role=%s host=%s listen=%s sender=%s:%s "
            "pool=%d B on %s backends=%s", self.stage_id, self.role, self.host,
            self._transport.listen_address or f"on first put ({self.settings.listen_port})",
            self.sender_host, self.sender_zmq_port, self.settings.memory_pool_size,
            self.settings.memory_pool_device, self._transport.backends)

    # ------------------------------------------------------------ helpers
    @property
    def zmq_port(self) -> Optional[int]:
        """Port of this connector's pull listener (None for a pure receiver)."""
        return self.settings.listen_port

    @property
    def can_put(self) -> bool:
        """Every role can put; a receiver starts listening on its first put."""
        return self.settings.listen_port is not None

    @property
    def engine_key(self) -> str:
        """Key of the underlying IO engine."""
        return self._transport.engine_key

    def get_connection_info(self) -> dict[str, Any]:
        """Where this connector serves pulls and which engine it uses."""
        return {"host": self.host, "zmq_port": self.zmq_port, "engine_key": self.engine_key,
                "can_put": self.can_put, "listening": self._transport.listening}

    def update_sender_info(self, sender_host: str, sender_zmq_port: int) -> None:
        """Default upstream endpoint for ``get`` calls without metadata."""
        host = resolve_host(str(sender_host))
        port = int(sender_zmq_port)
        if not 1 <= port <= 65535:
            raise ValueError(f"update_sender_info: sender_zmq_port must be in [1, 65535], got {sender_zmq_port!r}")
        with self._lock:
            self.sender_host, self.sender_zmq_port = host, port

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"Cannot {what}: MoriTransferEngineConnector is closed")

    # ---------------------------------------------------------------- put
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, Optional[dict[str, Any]]]:
        """Publish ``data`` for the stage ``to_stage`` to pull.

        Returns ``(True, size, {source_host, source_port, data_size,
        is_fast_path})`` or ``(False, 0, None)`` (reason logged).
        """
        self._check_open("put")
        key = self._make_key(put_key, from_stage, to_stage)
        t0 = time.perf_counter()
        try:
            if isinstance(data, (PoolBuffer, *_RAW_TYPES)) or _is_tensor(data):
                payload, fast = data, True
            elif hasattr(data, "release") and _is_tensor(getattr(data, "tensor", None)):
                payload, fast = data.tensor, True  # vLLM-Omni's ManagedBuffer of another connector
            else:
                payload, fast = self.serialize_obj(data), False
            size = self._transport.offer(key, payload, is_fast_path=fast)
        except (ValueError, MemoryError, KeyBusyError) as exc:
            logger.error("put of %r refused: %s", key, exc)
            return False, 0, None
        except Exception:
            logger.exception("put of %r failed", key)
            return False, 0, None
        logger.debug("put %r: %d bytes in %.3f ms (fast_path=%s)", key, size, (time.perf_counter() - t0) * 1e3, fast)
        return True, size, {"source_host": self.host, "source_port": self.zmq_port, "data_size": size,
                            "is_fast_path": fast}

    # ---------------------------------------------------------------- get
    def get(self, from_stage: str, to_stage: str, get_key: str,
            metadata: Optional[dict[str, Any]] = None) -> Optional[tuple[Any, int]]:
        """Pull ``get_key`` (see :meth:`get_with_deadline`), bounded by the settings' timeouts."""
        return self._get(from_stage, to_stage, get_key, metadata, None)

    def get_with_deadline(self, from_stage: str, to_stage: str, get_key: str,
                          metadata: Optional[dict[str, Any]] = None, *, deadline: float) -> Optional[tuple[Any, int]]:
        """Pull ``get_key`` but never wait past ``deadline`` (``time.monotonic()`` based).

        ``metadata`` may be the sender's full put metadata, only
        ``{source_host, source_port}`` (the sender is queried for the size),
        or None (the sender set by ``update_sender_info`` / the config is queried).

        Returns ``(obj, size)`` — for fast-path payloads ``obj`` is a pool
        buffer to ``release()`` — or None if the payload is not available yet.
        A pull still running at the deadline is kept and resumed by the next
        call for the same key; :meth:`abandon_get` gives it up.
        """
        return self._get(from_stage, to_stage, get_key, metadata, deadline)

    def _get(self, from_stage: str, to_stage: str, get_key: str, metadata: Optional[dict[str, Any]],
             deadline: Optional[float]) -> Optional[tuple[Any, int]]:
        self._check_open("get")
        if deadline is not None and time.monotonic() >= deadline:
            return None
        key = self._make_key(get_key, from_stage, to_stage)
        address, size, fast = self._source(metadata)
        result = self._transport.fetch(key, address, size, fast, deadline, tag=get_key)
        if result is None:
            return None
        if result.is_fast_path:
            return result.buffer, result.size
        try:
            return self.deserialize_obj(result.buffer.to_bytes()), result.size
        finally:
            result.buffer.release()

    def _source(self, metadata: Optional[dict[str, Any]]) -> tuple[str, Optional[int], Optional[bool]]:
        """``(tcp address, size or None, is_fast_path or None)`` of a get."""
        if metadata and metadata.get("source_host") and metadata.get("source_port"):
            host = resolve_host(str(metadata["source_host"]))
            port = int(metadata["source_port"])
            size = metadata.get("data_size")
            size = int(size) if isinstance(size, int) and size > 0 else None  # partial metadata: query
            fast = metadata.get("is_fast_path") if size is not None else None
            return f"tcp://{host}:{port}", size, fast
        with self._lock:
            host, port = self.sender_host, self.sender_zmq_port
        if not host or not port:
            raise RuntimeError(
                "MoriTransferEngineConnector.get: no sender endpoint — pass metadata with source_host/"
                "source_port, set sender_host/sender_zmq_port in the connector extra, or call "
                "update_sender_info(host, port)")
        return f"tcp://{host}:{port}", None, None

    def abandon_get(self, get_key: str) -> None:
        """Stop resuming pulls of ``get_key``; their buffers are freed once the sender answers."""
        if not self._closed:
            self._transport.abandon(get_key)

    def reap_consumed(self) -> None:
        """TTL sweep, release of answered abandoned pulls and finished late writes."""
        if not self._closed:
            self._transport.reap()

    # ------------------------------------------------------------ cleanup
    def cleanup(self, request_id: str, from_stage: Optional[str] = None, to_stage: Optional[str] = None) -> bool:
        """Withdraw a payload this connector put (freed once no transfer reads it).

        ``request_id`` is the put key; with both stages given it is combined
        like ``put`` does. Returns True if the payload existed.
        """
        if (from_stage is None) != (to_stage is None):
            raise ValueError("cleanup() takes both from_stage and to_stage, or neither")
        if self._closed:
            return False
        key = request_id if from_stage is None else self._make_key(request_id, from_stage, to_stage)
        return self._transport.retire(key)

    def health(self) -> dict[str, Any]:
        """``status`` plus counters, pool use, parked pulls and the routes used."""
        if self._closed:
            return {"status": "closed"}
        stats = self._transport.stats()
        ok = stats.get("listener_alive", True)
        return {"status": "healthy" if ok else "unhealthy", "host": self.host, "role": self.role,
                "stage_id": self.stage_id, "zmq_port": self.zmq_port, "engine_key": self.engine_key,
                "pool_device": self.settings.memory_pool_device, "backends": list(self._transport.backends),
                **stats}

    def close(self) -> None:
        """Release everything: listener, buffers, sockets, pool registration, remote engines."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._transport.close()


def _is_tensor(data: Any) -> bool:
    import torch  # noqa: PLC0415 (torch is imported by vLLM-Omni anyway)

    return isinstance(data, torch.Tensor)
