"""The connector's transport: an IO engine, its registered pool, and the pull handshake.

Independent of vLLM-Omni (it only moves bytes), so the same data path runs on
machines without vLLM-Omni installed (the GPU test and benchmark use it directly).

Flow of one payload (the sender writes, like the stock connector):

1. sender ``offer(key, data)``: copy into its pool, publish in the outbox;
2. receiver ``fetch``: query the sender for the size unless known, allocate a
   destination in its own pool and send a :class:`PullRequest` with its packed
   ``EngineDesc`` / pool ``MemoryDesc``;
3. sender worker: check the length against the source buffer, pin it, one
   ``batch_write`` into the receiver's pool, wait for the statuses with a
   bound, unpin (retiring the payload on success) and answer;
4. receiver: on ``ok`` the bytes are in its pool; hand out the buffer.

A receiver that stops waiting (deadline, abandoned get) never frees a
destination buffer the sender may still write into: the pull is *parked* with
its socket until the sender's answer arrives (or a bound long past the
sender's own write bound passes).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
import zmq

from . import protocol
from mori_integrations.common.log_limit import warn_if_exposed

from .client import PullClient, wait_reply
from .inbox import ParkedPull, ParkedPulls
from .core_import import load_core
from .outbox import KeyBusyError, Outbox, OutboxEntry, PullRefused
from .peers import RemoteEngines
from .pool import MemoryPool, PoolBuffer
from .protocol import NotFound, PullRequest, PullResponse, QueryRequest, QueryResponse, Rejected
from .server import PullServer
from .settings import ConnectorSettings

__all__ = ["OmniTransport", "FetchResult", "Payload", "KeyBusyError"]

logger = logging.getLogger(__name__)

Payload = Union[torch.Tensor, bytes, bytearray, memoryview, PoolBuffer]
_JANITOR_PERIOD_S = 0.5
_MAX_REMOTE_ENGINES = 1024
_CLOSE_WAIT_S = 2.0


@dataclass
class FetchResult:
    """A payload that landed in this transport's pool (release ``buffer`` when done)."""

    buffer: PoolBuffer
    size: int
    is_fast_path: bool
    query_ms: float
    pull_ms: float


def _byte_view(data: Union[torch.Tensor, bytes, bytearray, memoryview]) -> torch.Tensor:
    """A flat uint8 view of ``data`` (copies only non-contiguous tensors and read-only buffers)."""
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return t.reshape(-1).view(torch.uint8)
    mv = memoryview(data).cast("B")
    if mv.readonly:  # torch.frombuffer wants a writable buffer
        return torch.from_numpy(np.frombuffer(mv, dtype=np.uint8).copy())
    return torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)


def _sync_cuda(*tensors: torch.Tensor) -> None:
    """Wait for the copies queued on the devices of ``tensors``: the peer's engine
    reads the pool from another process, outside torch's stream ordering."""
    for dev in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()


class OmniTransport:
    """IO engine + registered pool + control plane of one connector.

    Args:
        settings: validated connector settings.
        name: label for the engine key (role/stage appear in it too).
    """

    def __init__(self, settings: ConnectorSettings, name: str = "omni") -> None:
        io = load_core()  # raises CoreUnavailableError with the fix
        self.settings = settings
        self._io = io
        self._closed = False
        self._lock = threading.Lock()
        self._server: Optional[PullServer] = None
        self._stuck: list[tuple[OutboxEntry, list[Any]]] = []
        self._remote_mems: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._routes: collections.Counter[str] = collections.Counter()
        self._route_of: dict[bytes, str] = {}
        self._metrics: collections.Counter[str] = collections.Counter()
        self._metrics_lock = threading.Lock()
        self._active = 0
        self._active_cv = threading.Condition(self._lock)
        self.engine = None
        self.pool: Optional[MemoryPool] = None
        self._ctx: Optional[zmq.Context] = None
        self._janitor: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.unavailable_backends: dict[str, str] = {}  # backend -> why it could not be created
        try:
            self.engine_key = (f"{name}-{settings.role}-s{settings.stage_id}-tp{settings.tp_rank}-"
                               f"{uuid.uuid4().hex[:8]}-pid{os.getpid()}")
            # backend_type 'tcp' (or 'rdma') means exactly that: keep the core from
            # adding its automatic same-node XGMI route on GPU hosts.
            self.engine = io.IOEngine(self.engine_key, io.IOEngineConfig(
                host=settings.host, port=0, auth_secret=settings.auth_secret,
                enable_auto_xgmi=settings.backend_type in ("auto", "xgmi")))
            self.backends = self._create_backends()
            self._peers = RemoteEngines(self.engine, io, _MAX_REMOTE_ENGINES)
            self.pool = MemoryPool(settings.memory_pool_size, settings.memory_pool_device)
            self.pool.register(self.engine)
            self.engine_desc = self.engine.get_engine_desc()
            self.engine_desc_packed = self.engine_desc.pack()
            self._ctx = zmq.Context()
            self.codec = protocol.make_codec(settings.auth_secret)
            self.outbox = Outbox(settings.buffer_ttl_seconds)
            self.parked = ParkedPulls(settings.buffer_ttl_seconds)
            self.client = PullClient(self._ctx, self.codec)
            if settings.role in ("sender", "dual"):
                self.listen()
            self._janitor = threading.Thread(target=self._janitor_loop, name="omni-mori-janitor", daemon=True)
            self._janitor.start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ set-up
    def _create_backends(self) -> list[str]:
        io, s = self._io, self.settings
        # TCP always: it serves CPU pools and is the fallback for GPU pools.
        self.engine.create_backend(io.BackendType.TCP, io.TcpBackendConfig(
            num_connections=s.tcp_num_connections, op_timeout_ms=s.tcp_op_timeout_ms,
            heartbeat_timeout_ms=s.tcp_heartbeat_timeout_ms))
        made = ["tcp"]
        if s.backend_type == "rdma":
            try:
                self.engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig(
                    s.qp_per_transfer, s.post_batch_size, s.num_worker_threads, io.PollCqMode.POLLING, False))
            except Exception as exc:
                raise RuntimeError(f"backend_type 'rdma' was requested but the RDMA backend cannot be "
                                   f"created here: {exc}") from exc
            made.append("rdma")
        if s.memory_pool_device.startswith("cuda") and s.backend_type in ("auto", "xgmi"):
            try:
                self.engine.create_backend(io.BackendType.XGMI, io.XgmiBackendConfig(
                    num_streams=s.xgmi_num_streams, num_events=s.xgmi_num_events))
                made.append("xgmi")
            except Exception as exc:
                if s.backend_type == "xgmi":
                    raise RuntimeError(f"backend_type 'xgmi' was requested but the intra-node GPU backend "
                                       f"cannot be created here: {exc}") from exc
                self.unavailable_backends["xgmi"] = str(exc)
                logger.info("XGMI backend unavailable (%s); GPU pools move over TCP", exc)
        # What the engine really has: on a GPU host the core adds XGMI by itself
        # with backend_type 'auto' (it then also serves CPU-pool -> GPU-pool writes).
        have = {str(b).split(".")[-1].lower() for b in self.engine.backends()}
        return made + sorted(have - set(made))

    @property
    def listening(self) -> bool:
        """True once the pull listener runs."""
        return self._server is not None

    @property
    def listen_address(self) -> Optional[str]:
        """``tcp://host:port`` of the pull listener, if any."""
        return None if self._server is None else self._server.address

    def listen(self) -> None:
        """Start the pull listener (idempotent). Raises PortInUseError on a busy port."""
        with self._lock:
            if self._server is not None:
                return
            if self._closed:
                raise RuntimeError("MoriTransferEngineConnector is closed")
            port = self.settings.listen_port
            if port is None:
                raise RuntimeError(
                    "this connector (role 'receiver') has no port to serve put() payloads on: set "
                    "extra['outgoing_zmq_port'] or use role 'dual' with zmq_port")
            self._server = PullServer(self._ctx, self.codec, self.settings.host, port, self._on_query,
                                      self._on_pull, self.settings.num_pull_workers)
            warn_if_exposed(logger, f"omni mori connector {self.engine_key}", self.settings.host,
                            self.codec.authenticated)
            logger.info("omni mori connector %s serves pulls on %s", self.engine_key, self._server.address)

    # -------------------------------------------------------- call guard
    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("MoriTransferEngineConnector is closed")
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            self._active_cv.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._metrics_lock:
            self._metrics[name] += n

    # ------------------------------------------------------------ sender
    def offer(self, key: str, data: Payload, is_fast_path: bool) -> int:
        """Publish ``data`` under ``key`` for one receiver to pull; returns its size.

        A live :class:`PoolBuffer` of this pool is published zero-copy (the
        caller keeps ownership); anything else is copied into the pool.

        Raises:
            ValueError: empty payload. MemoryError: pool full.
            KeyBusyError: ``key`` is being transferred. PortInUseError: the
            listener (started on first use by a middle stage) cannot bind.
        """
        _check_key(key)
        self._enter()
        try:
            if self._server is None:
                self.listen()
            if isinstance(data, PoolBuffer) and self.pool.owns(data):
                buffer, owns = data, False
            elif isinstance(data, (bytes, bytearray, memoryview)) and not self.pool.is_cuda:
                # Serialised objects arrive as bytes: one copy straight into the pool.
                src_np = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
                if src_np.size == 0:
                    raise ValueError(f"put of an empty payload under {key!r}")
                buffer, owns = self.pool.alloc(src_np.size), True
                buffer.tensor.numpy()[:] = src_np
            else:
                src = _byte_view(data.tensor if isinstance(data, PoolBuffer) else data)
                if src.numel() == 0:
                    raise ValueError(f"put of an empty payload under {key!r}")
                buffer, owns = self.pool.alloc(src.numel()), True
                try:
                    if src.is_cuda or self.pool.is_cuda:
                        buffer.tensor.copy_(src)
                        _sync_cuda(buffer.tensor, src)
                    else:  # one plain memcpy: no intra-op thread pool for a host copy
                        np.copyto(buffer.tensor.numpy(), src.numpy())
                except BaseException:
                    buffer.release()
                    raise
            try:
                self.outbox.add(key, buffer, is_fast_path, owns_buffer=owns)
            except KeyBusyError:
                if owns:
                    buffer.release()
                raise
            self._count("puts")
            self._count("bytes_offered", buffer.size)
            return buffer.size
        finally:
            self._leave()

    def retire(self, key: str) -> bool:
        """Withdraw ``key`` (its bytes are freed once no transfer reads them)."""
        return self.outbox.discard(key)

    def _on_query(self, req: QueryRequest) -> object:
        info = self.outbox.info(req.key)
        if info is None:
            return NotFound(seq=req.seq, key=req.key)
        return QueryResponse(seq=req.seq, key=req.key, data_size=info[0], is_fast_path=info[1])

    def _remote_mem(self, mem_packed: bytes) -> Any:
        """Decode the receiver's pool descriptor (cached)."""
        io = self._io
        with self._lock:
            if self._closed:
                raise RuntimeError("connector is closing")
            mem = self._remote_mems.get(mem_packed)
            if mem is None:
                mem = io.MemoryDesc.unpack(mem_packed)
                self._remote_mems[mem_packed] = mem
                if len(self._remote_mems) > 256:
                    self._remote_mems.popitem(last=False)
            else:
                self._remote_mems.move_to_end(mem_packed)
            return mem

    def _on_pull(self, req: PullRequest) -> object:
        try:
            entry = self.outbox.pin(req.key, req.length)
        except PullRefused as exc:
            if exc.not_found:
                return NotFound(seq=req.seq, key=req.key)
            self._count("pull_refused")
            return PullResponse(seq=req.seq, key=req.key, ok=False, error=exc.reason)
        consumed = pending = False
        peer_key = None
        try:
            try:
                peer_key = self._peers.acquire(req.engine_desc).key
                remote_mem = self._remote_mem(req.mem_desc)
            except Exception as exc:
                self._count("pull_refused")
                return PullResponse(seq=req.seq, key=req.key, ok=False,
                                    error=f"bad receiver descriptor: {exc}"[: protocol.MAX_ERROR_CHARS])
            io = self._io
            uid = self.engine.allocate_transfer_uid()
            statuses = self.engine.batch_write([self.pool.desc], [[entry.buffer.offset]], [remote_mem],
                                               [[req.dst_offset]], [[entry.size]], [uid])
            bound_s = self.settings.transfer_timeout_for(entry.size)
            code = self.engine.wait_all(statuses, int(bound_s * 1000))
            if code == io.StatusCode.IN_PROGRESS:
                # Never free bytes a write may still read: keep the pin until it ends.
                pending = True
                with self._lock:
                    self._stuck.append((entry, statuses))
                self._count("write_timeouts")
                return PullResponse(seq=req.seq, key=req.key, ok=False, write_pending=True,
                                    error=f"write of {entry.size} bytes did not finish within {bound_s:.1f} s")
            if code != io.StatusCode.SUCCESS:
                msg = next((s.Message() for s in statuses if s.Failed()), "")
                self._count("write_errors")
                logger.warning("write of %r failed (%s: %s); the payload stays for a retry", req.key, code.name, msg)
                return PullResponse(seq=req.seq, key=req.key, ok=False,
                                    error=f"{code.name}: {msg}"[: protocol.MAX_ERROR_CHARS])
            consumed = True
            self._count_route(req.mem_desc, remote_mem)
            self._count("bytes_sent", entry.size)
            return PullResponse(seq=req.seq, key=req.key, ok=True)
        finally:
            if peer_key is not None:
                self._peers.release(peer_key)
            if not pending:
                self.outbox.unpin(entry, consumed)

    def _count_route(self, mem_packed: bytes, remote_mem: Any) -> None:
        route = self._route_of.get(mem_packed)
        if route is None:
            route = self.engine.route_of(self.pool.desc, remote_mem).name
            self._route_of[mem_packed] = route
        self._routes[route] += 1

    # ---------------------------------------------------------- receiver
    def fetch(
        self,
        key: str,
        address: str,
        size: Optional[int] = None,
        is_fast_path: Optional[bool] = None,
        deadline: Optional[float] = None,
        tag: str = "",
    ) -> Optional[FetchResult]:
        """Pull payload ``key`` from the sender at ``address`` into this pool.

        Args:
            size / is_fast_path: from the sender's put metadata; when ``size``
                is None the sender is queried first.
            deadline: monotonic time after which to stop waiting (the pull is
                then parked and a later fetch of the same key resumes it).
            tag: the caller's key, used by :meth:`abandon`.

        Returns:
            The payload, or None when it is not there (yet), the sender is
            unreachable, or the deadline passed. Never blocks past ``deadline``
            nor past the query / transfer bounds of the settings.
        """
        _check_key(key)
        if size is not None and not 0 < size <= self.pool.size:
            raise ValueError(f"fetch of {key!r}: size must be in [1, {self.pool.size}] (the pool), got {size}")
        self._enter()
        try:
            self._reap()
            t0 = time.monotonic()
            parked = self.parked.take(key)
            if parked is not None:
                return self._await(parked, deadline, t0, 0.0)
            if size is None:
                info = self._query(key, address, deadline)
                if info is None:
                    return None
                size, is_fast_path = info
            t1 = time.monotonic()
            if deadline is not None and t1 >= deadline:
                return None
            try:
                buffer = self.pool.alloc(size)
            except MemoryError as exc:
                self._count("pool_exhausted")
                logger.error("cannot receive %r: %s", key, exc)
                return None
            seq = self.client.next_seq()
            request = PullRequest(seq=seq, key=key, engine_desc=self.engine_desc_packed,
                                  mem_desc=self.pool.desc_packed, dst_offset=buffer.offset, length=size)
            try:
                sock, binding = self.client.send(address, request)
            except (TimeoutError, zmq.ZMQError) as exc:
                buffer.release()  # nothing was sent, so nothing can be written
                logger.warning("pull of %r towards %s not sent: %s", key, address, exc)
                return None
            bound = self.settings.transfer_timeout_for(size)
            pull = ParkedPull(key, tag or key, address, sock, seq, buffer, bool(is_fast_path), t1,
                               give_up_at=t1 + 2 * bound + self.settings.query_timeout_s, codec=self.codec,
                               reply_binding=binding)
            return self._await(pull, deadline, t1, (t1 - t0) * 1000)
        finally:
            self._leave()

    def _query(self, key: str, address: str, deadline: Optional[float]) -> Optional[tuple[int, bool]]:
        limit = time.monotonic() + self.settings.query_timeout_s
        if deadline is not None:
            limit = min(limit, deadline)
        try:
            reply = self.client.request(address, QueryRequest(seq=self.client.next_seq(), key=key), limit)
        except (TimeoutError, zmq.ZMQError) as exc:
            logger.warning("query of %r towards %s failed: %s", key, address, exc)
            return None
        if reply is None:
            self._count("query_timeouts")
            logger.debug("no answer from %s about %r before the deadline", address, key)
            return None
        if isinstance(reply, QueryResponse):
            return reply.data_size, reply.is_fast_path
        if isinstance(reply, Rejected):
            logger.error("sender %s rejected the query for %r: %s", address, key, reply.reason)
        return None

    def _await(self, pull: ParkedPull, deadline: Optional[float], t0: float, query_ms: float) -> Optional[FetchResult]:
        """Wait for ``pull``'s answer until min(deadline, transfer bound); park it on timeout."""
        reply = pull.done
        if reply is None:
            bound_at = pull.started + self.settings.transfer_timeout_for(pull.buffer.size)
            wait_until = bound_at if deadline is None else min(deadline, bound_at)
            try:
                reply = wait_reply(self.codec, pull.sock, pull.seq, wait_until, pull.reply_binding)
            except zmq.ZMQError as exc:
                logger.warning("pull of %r: control socket failed: %s", pull.key, exc)
                reply = None
            if reply is None:
                if time.monotonic() >= bound_at:
                    self._count("pull_timeouts")
                    logger.warning("no answer to the pull of %r from %s within %.1f s; its destination "
                                   "buffer stays reserved until the sender answers", pull.key, pull.address,
                                   bound_at - pull.started)
                if not pull.detached:  # the late answer will arrive on this socket: keep it
                    self.client.detach(pull.address)
                    pull.detached = True
                self.parked.park(pull)
                return None
        if isinstance(reply, Rejected) and reply.seq == 0:
            reply = PullResponse(seq=pull.seq, key=pull.key, ok=False, error=reply.reason)
        return self._finish(pull, reply, query_ms, (time.monotonic() - t0) * 1000)

    def _finish(self, pull: ParkedPull, reply: object, query_ms: float, pull_ms: float) -> Optional[FetchResult]:
        if pull.detached:
            pull.sock.close(linger=0)
        if isinstance(reply, PullResponse) and reply.ok:
            self._count("gets")
            self._count("bytes_received", pull.buffer.size)
            return FetchResult(pull.buffer, pull.buffer.size, pull.is_fast_path, query_ms, pull_ms)
        if isinstance(reply, PullResponse) and reply.write_pending:
            pull.buffer.leak()  # the sender may still write there: never reuse these bytes
        else:
            pull.buffer.release()
        if isinstance(reply, NotFound):
            return None  # consumed by another receiver or withdrawn in between
        self._count("get_errors")
        reason = reply.error if isinstance(reply, PullResponse) else getattr(reply, "reason", reply)
        logger.error("pull of %r from %s failed: %s", pull.key, pull.address, reason)
        return None

    def abandon(self, tag: str) -> int:
        """The caller gives up on its key ``tag``: its parked pulls are never resumed.

        Their buffers stay reserved until the sender answers (the write has
        then ended) — an abandoned get never cancels a write in progress.
        Returns how many pulls were abandoned.
        """
        count = self.parked.abandon(tag)
        self.reap()
        return count

    # ------------------------------------------------------ housekeeping
    def reap(self) -> None:
        """TTL sweep of the outbox, finished stuck writes, answered or hopeless parked pulls."""
        try:
            self._enter()
        except RuntimeError:
            return  # closed: nothing left to reap
        try:
            self._reap()
        finally:
            self._leave()

    def _reap(self) -> None:
        if self._closed:
            return
        self.outbox.sweep()
        with self._lock:
            stuck, self._stuck = self._stuck, []
        still = []
        for entry, statuses in stuck:
            if any(s.InProgress() or s.Init() for s in statuses):
                still.append((entry, statuses))
            else:
                self.outbox.unpin(entry, consumed=all(s.Succeeded() for s in statuses))
        with self._lock:
            self._stuck.extend(still)
        self.parked.reap()

    def _janitor_loop(self) -> None:
        while not self._stop.wait(_JANITOR_PERIOD_S):
            try:
                self._reap()
            except Exception:
                logger.exception("omni mori janitor")

    # ------------------------------------------------------------ status
    def stats(self) -> dict[str, Any]:
        """Counters, pool use, parked pulls and routes for ``health()``."""
        with self._metrics_lock:
            out: dict[str, Any] = dict(self._metrics)
        if self.pool is not None:
            out.update(self.pool.stats())
        if hasattr(self, "outbox"):
            out.update(self.outbox.stats())
            out.update(self.parked.stats())
        with self._lock:
            out["stuck_writes"] = len(self._stuck)
            out["remote_engines"] = len(self._peers) if hasattr(self, "_peers") else 0
            out["routes"] = dict(self._routes)
        if self._server is not None:
            out["listener_alive"] = self._server.alive
            out["malformed_requests"] = self._server.malformed
            out["rejected_requests"] = self._server.rejected_busy
        return out

    # ------------------------------------------------------------- close
    def close(self) -> None:
        """Stop serving, free everything, deregister memory and remote engines (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Calls in progress are bounded; give them a moment before tearing sockets down.
            self._active_cv.wait_for(lambda: self._active == 0, timeout=_CLOSE_WAIT_S)
            busy = self._active
        self._stop.set()
        if self._janitor is not None:
            self._janitor.join(timeout=5.0)
        if self._server is not None:
            self._server.close()
        with self._lock:
            stuck, self._stuck = self._stuck, []
        if hasattr(self, "outbox"):
            self.parked.drain()  # the pool is deregistered below: late writes into it are refused
            self.outbox.drain()
        if stuck and self.engine is not None:
            self.engine.wait_all([s for _, sts in stuck for s in sts], 1000)
        if self._ctx is not None:
            if busy:
                logger.warning("closing with %d calls still running; leaving their sockets to process exit", busy)
            else:
                self._ctx.destroy(linger=0)
        if self.engine is not None:
            if self.pool is not None:
                try:
                    self.pool.deregister(self.engine)
                except Exception as exc:
                    logger.warning("deregister_memory failed: %s", exc)
            for desc in self._peers.close() if hasattr(self, "_peers") else []:
                try:
                    self.engine.deregister_remote_engine(desc)
                except Exception as exc:
                    logger.debug("deregister_remote_engine(%s) failed: %s", desc.key, exc)
            self.engine = None  # the engine's destructor stops its backends
        self.pool = None


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not 0 < len(key) <= protocol.MAX_KEY_CHARS:
        raise ValueError(f"payload key must be a str of 1..{protocol.MAX_KEY_CHARS} characters, "
                         f"got {type(key).__name__} of length {len(key) if isinstance(key, str) else '-'}")
