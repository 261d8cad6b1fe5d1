"""The worker-side transfer agent: IO engine, registered KV, peers, planning, control plane.

Independent of vLLM (it sees tensors, block ids and plain dataclasses), so the same code
moves KV inside a vLLM worker and in tests that fake only vLLM's side (the GPU test
drives two agents over XGMI in two processes). :mod:`.producer` and :mod:`.consumer`
hold the per-request state machines; this module holds what they share.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import msgspec
import numpy as np
import numpy.typing as npt
import zmq

from mori_core.io import (
    BackendType,
    EngineDesc,
    MemoryDesc,
    MemoryLocationType,
    TcpBackendConfig,
    TransferStatus,
    XgmiBackendConfig,
)
from mori_integrations.common.doorbell import DoorbellBoard, DoorbellError, DoorbellRing
from mori_integrations.common.engine_setup import create_engine
from mori_integrations.common.local_inbox import LocalSender, inbox_name, try_inbox
from mori_integrations.common.segments import PlanError, TransferBatch, lead_units
from mori_integrations.vllm.kv_connector.config import ConnectorConfig, rank_port
from mori_integrations.vllm.kv_connector.control import ControlServer, HandshakeError, Notifier, fetch_metadata
from mori_integrations.vllm.kv_connector.heartbeat import ProxyHeartbeat
from mori_integrations.vllm.kv_connector.layout import describe_kv_caches
from mori_integrations.vllm.kv_connector.messages import (
    AgentMetadata,
    ConsumerDone,
    LayerLayout,
    WriteDone,
    WriteRequest,
    encoded_metadata,
    make_codec,
)
from mori_integrations.vllm.kv_connector.metadata import PeerAddress
from mori_integrations.vllm.kv_connector.peer_watch import Address, PeerWatch
from mori_integrations.vllm.kv_connector.planner import LayerPlanner, PreparedLayers, pair_blocks
from mori_integrations.vllm.kv_connector.stats import TransferCounters
from mori_integrations.vllm.kv_connector.trace import PhaseTrace

__all__ = ["AgentIdentity", "Peer", "TransferAgent", "pair_blocks"]

logger = logging.getLogger(__name__)

_MAX_PEERS = 256
_MAX_PLAN_GROUPS = 1024  # cached layer groupings (peers x directions x layer lists)


@dataclasses.dataclass(frozen=True)
class AgentIdentity:
    """Who this worker is, in the terms peers need."""

    engine_id: str  # vLLM's kv_transfer_config.engine_id
    tp_rank: int
    tp_size: int
    dp_rank: int  # DP rank local to this node (port arithmetic)
    total_kv_heads: int
    replicated_heads: bool  # MLA: every rank holds the whole cache
    group_block_sizes: List[int]
    role: str = "P"  # "P" (prefill / kv_producer, also kv_both) or "D": for router registration
    dp_size: int = 1


@dataclasses.dataclass
class Peer:
    """A remote worker: its metadata, registered engine and unpacked memory descriptors.

    ``key`` is its IO engine key, unique per process: a server restarted on the same
    ports is another peer. ``seen``: when it last proved alive (handshake, transfer).
    """

    meta: AgentMetadata
    key: str
    regions: List[MemoryDesc]
    layers: Dict[str, LayerLayout]
    seen: float = 0.0


class TransferAgent:
    """Everything one worker needs to move KV (see the module docstring).

    Args:
        config: validated connector configuration.
        identity: this worker's ranks and KV shape.
        kv_caches: layer name -> vLLM's 4D KV view.
        layer_groups: layer name -> KV cache group index (transferable groups only).
        num_blocks: manager blocks per layer.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        identity: AgentIdentity,
        kv_caches: Mapping[str, Any],
        layer_groups: Mapping[str, int],
        num_blocks: int,
    ) -> None:
        from mori_integrations.vllm.kv_connector.consumer import ConsumerSide
        from mori_integrations.vllm.kv_connector.producer import ProducerSide

        self.config = config
        self.identity = identity
        self.lock = threading.RLock()
        self.counters = TransferCounters()
        self._peers: Dict[str, Peer] = {}
        self._key_by_desc: Dict[bytes, str] = {}  # packed EngineDesc -> its key
        self._peer_by_address: Dict[Address, Peer] = {}
        self._async_peers: Dict[str, bool] = {}  # engine key -> submits_async
        self._rings: Dict[str, Optional[DoorbellRing]] = {}  # consumer engine key -> its board (None: none here)
        self.doorbells: Optional[DoorbellBoard] = None
        self._closed = False
        self.control: Optional[ControlServer] = None
        self.heartbeat: Optional[ProxyHeartbeat] = None
        self.watch: Optional[PeerWatch] = None
        self.pool: Optional[ThreadPoolExecutor] = None
        self.ctx = zmq.Context()
        layout = describe_kv_caches(kv_caches, layer_groups, num_blocks)
        self.layers = layout.layers
        self._layer_names = [layer.name for layer in self.layers]
        self._local_layers = {layer.name: layer for layer in self.layers}
        self.planner = LayerPlanner()
        self._plan_groups: Dict[Tuple[str, bool, Optional[Tuple[str, ...]]], List[Any]] = {}
        self.trace = PhaseTrace()
        self._kv_caches = dict(kv_caches)  # keep the registered memory alive
        gpu = any(r.device_index >= 0 for r in layout.regions)
        self.engine_key = (
            f"vllm-{identity.engine_id[:12]}-dp{identity.dp_rank}-tp{identity.tp_rank}-pid{os.getpid()}-"
            f"{uuid.uuid4().hex[:8]}"
        )
        setup = create_engine(
            self.engine_key,
            config.host_ip,
            gpu_memory=gpu,
            rdma=config.rdma,
            backend=config.backend,
            auth_secret=config.auth_secret,
            tcp=TcpBackendConfig(num_connections=config.tcp_num_connections, op_timeout_ms=config.tcp_op_timeout_ms),
            xgmi=XgmiBackendConfig(proxy_blocks=config.xgmi_proxy_blocks),
        )
        self.engine = setup.engine
        self.backends = setup.describe()
        try:
            self.regions = [
                self.engine.register_memory(
                    r.ptr, r.nbytes, r.device_index, MemoryLocationType.GPU if r.device_index >= 0 else MemoryLocationType.CPU
                )
                for r in layout.regions
            ]
            self.codec = make_codec(config.auth_secret)
            inbox = None
            if config.same_host_signals:
                self.doorbells = DoorbellBoard.create(self.engine_key)
                inbox = try_inbox(inbox_name(self.engine_key))
            self.handshake_port = rank_port(config.handshake_port, identity.dp_rank, identity.tp_size, identity.tp_rank)
            self.notify_port = rank_port(config.notify_port, identity.dp_rank, identity.tp_size, identity.tp_rank)
            self.metadata = AgentMetadata(
                engine_id=identity.engine_id,
                engine_desc=self.engine.get_engine_desc().pack(),
                regions=[d.pack() for d in self.regions],
                layers=list(self.layers),
                tp_rank=identity.tp_rank,
                tp_size=identity.tp_size,
                dp_rank=identity.dp_rank,
                total_kv_heads=identity.total_kv_heads,
                replicated_heads=identity.replicated_heads,
                block_size=identity.group_block_sizes[0],
                group_block_sizes=list(identity.group_block_sizes),
                notify_host=config.host_ip,
                notify_port=self.notify_port,
                doorbell=self.doorbells.name if self.doorbells is not None else "",
                inbox=inbox.name if inbox is not None else "",
            )
            self.metadata_raw = encoded_metadata(self.metadata)  # what every WriteRequest carries
            local = LocalSender() if config.same_host_signals else None
            self.notifier = Notifier(self.codec, self.ctx, local)
            self.pool = ThreadPoolExecutor(config.transfer_threads, thread_name_prefix=f"mori-kv-tp{identity.tp_rank}")
            self.producer = ProducerSide(self)
            self.consumer = ConsumerSide(self)
            self.control = ControlServer(
                self.codec,
                self.ctx,
                config.host_ip,
                self.handshake_port,
                self.notify_port,
                lambda: self.metadata,
                self._on_notify,
                name=f"mori-kv-ctl-tp{identity.tp_rank}",
                inbox=inbox,
                spin_s=config.control_spin_ms / 1000,
            )
            self.watch = PeerWatch(self.codec, self.ctx, self.engine_key, self.consumer.watched_producers,
                                   self.consumer.on_producer_gone, name=f"mori-kv-watch-tp{identity.tp_rank}")
            if config.proxy_ip and identity.tp_rank == 0 and identity.dp_rank == 0:
                self.heartbeat = ProxyHeartbeat(self.ctx, config.proxy_ip, config.proxy_ping_port, {
                    "type": identity.role,
                    "http_address": f"{config.host_ip}:{config.http_port}",
                    "zmq_address": f"host:{config.host_ip},handshake:{config.handshake_port},notify:{config.notify_port}",
                    "dp_size": identity.dp_size,
                    "tp_size": identity.tp_size,
                    "transfer_mode": config.default_mode.upper(),
                })
        except BaseException:
            self.close()
            raise
        logger.info(
            "MoriSuiteConnector worker tp%d/%d dp%d: engine %s, IO backends %s, %d KV layers in %d region(s) "
            "(%s memory), control %s:%d (handshake) / %d (notify)%s",
            identity.tp_rank,
            identity.tp_size,
            identity.dp_rank,
            self.engine_key,
            self.backends,
            len(self.layers),
            len(self.regions),
            "GPU" if gpu else "host",
            config.host_ip,
            self.handshake_port,
            self.notify_port,
            ", authenticated" if self.codec.authenticated else "",
        )

    # ------------------------------------------------------------- identity
    def bind_instance(self, instance_id: str) -> None:
        """Name the server process this worker belongs to (its scheduler's nonce) in our handshake.

        Peers load our blocks only for requests of this instance. Called with every step; a
        worker never changes instance (its scheduler's lifetime is the process's).
        """
        if not instance_id or instance_id == self.metadata.instance:
            return
        if self.metadata.instance:
            raise RuntimeError(f"MoriSuiteConnector: worker of instance {self.metadata.instance} was told it is "
                               f"instance {instance_id}")
        self.metadata = msgspec.structs.replace(self.metadata, instance=instance_id)

    # ---------------------------------------------------------------- peers
    def _on_notify(self, message: Any) -> None:
        if isinstance(message, WriteRequest):
            self.producer.on_write_request(message)
        elif isinstance(message, ConsumerDone):
            self.producer.on_consumer_done(message)
        elif isinstance(message, WriteDone):
            self.consumer.on_write_done(message)
        else:
            logger.warning("MoriSuiteConnector: unexpected %s on the notify port", type(message).__name__)

    def peer_from_meta(self, meta: AgentMetadata) -> Peer:
        """The peer described by ``meta`` (its engine registered once)."""
        with self.lock:  # every write request carries the same metadata: unpacked once per peer
            key = self._key_by_desc.get(meta.engine_desc)
        desc = None
        if key is None:
            desc = EngineDesc.unpack(meta.engine_desc)
            key = desc.key
            with self.lock:
                if len(self._key_by_desc) >= _MAX_PEERS:
                    self._key_by_desc.pop(next(iter(self._key_by_desc)))
                self._key_by_desc[meta.engine_desc] = key
        with self.lock:
            peer = self._peers.get(key)
            if peer is not None:
                if peer.meta.instance != meta.instance:  # the same process learned its instance since
                    peer.meta = meta
                return peer
        if desc is None:
            desc = EngineDesc.unpack(meta.engine_desc)
        try:
            regions = [MemoryDesc.unpack(b) for b in meta.regions]
        except (ValueError, RuntimeError, TypeError) as e:
            raise HandshakeError(f"peer {desc.key} sent an undecodable memory descriptor: {e}") from None
        peer = Peer(meta=meta, key=desc.key, regions=regions, layers={layer.name: layer for layer in meta.layers})
        with self.lock:
            if desc.key not in self._peers:
                self.engine.register_remote_engine(desc)
                if len(self._peers) >= _MAX_PEERS:  # forget the oldest peer (a restarted server leaves one behind)
                    old = self._peers.pop(next(iter(self._peers)))
                    self._peer_by_address = {a: p for a, p in self._peer_by_address.items() if p is not old}
                self._peers[desc.key] = peer
            return self._peers[desc.key]

    def peer_address(self, address: PeerAddress, rank: int, tp_size: int) -> Address:
        """The handshake address of rank ``rank`` of the producer at ``address``."""
        return address.host, rank_port(address.handshake_port, address.dp_rank, tp_size, rank)

    def fetch_peer(
        self,
        address: PeerAddress,
        rank: int,
        tp_size: int,
        engine_id: Optional[str] = None,
        instance_id: Optional[str] = None,
    ) -> Peer:
        """Rank ``rank`` of the producer at ``address``, from a cached handshake when it can be trusted.

        The cache follows the process, not the address: an entry is redone when the peer was
        not heard from for ``handshake_ttl`` or when ``engine_id`` (vLLM's engine id the
        request's KV lives on, ``remote_engine_id``) or ``instance_id`` (the server process
        that computed it, ``remote_instance_id``) is not the cached peer's; it is dropped
        when a handshake or a transfer with the peer fails (:meth:`forget`). Raises
        HandshakeError when the producer cannot be reached, or when the server there now is
        not engine ``engine_id`` / instance ``instance_id`` (it restarted after computing the
        request's KV: that KV is gone, and its blocks at those ids hold other KV).
        """
        peer = self.cached_peer(address, rank, tp_size, engine_id, instance_id)
        if peer is not None:
            return peer
        where = self.peer_address(address, rank, tp_size)
        host, port = where
        try:
            meta = fetch_metadata(
                self.codec, self.ctx, host, port, self.engine_key, self.config.handshake_timeout_s
            )
            if meta.tp_rank != rank or meta.dp_rank != address.dp_rank:
                raise HandshakeError(
                    f"{host}:{port} is tp rank {meta.tp_rank} dp rank {meta.dp_rank}, expected tp rank {rank} "
                    f"dp rank {address.dp_rank} (remote_tp_size / remote_dp_rank in kv_transfer_params?)"
                )
            peer = self.peer_from_meta(meta)
        except HandshakeError:
            self.forget(where)  # whatever was cached there is not what answers now
            raise
        with self.lock:
            peer.seen = time.monotonic()
            self._peer_by_address[where] = peer
        if engine_id is not None and meta.engine_id != engine_id:
            raise HandshakeError(
                f"{host}:{port} is now engine {meta.engine_id}, but the request's KV is on engine {engine_id} "
                "(the prefill restarted after it computed the request: its KV is gone)"
            )
        if instance_id is not None and meta.instance != instance_id:
            raise HandshakeError(
                f"{host}:{port} is now prefill instance {meta.instance or '(no step run yet)'} of engine "
                f"{meta.engine_id}, but the request's KV was computed by instance {instance_id} (the prefill "
                "restarted after it computed the request: its KV is gone)"
            )
        return peer

    def cached_peer(
        self,
        address: PeerAddress,
        rank: int,
        tp_size: int,
        engine_id: Optional[str] = None,
        instance_id: Optional[str] = None,
    ) -> Optional[Peer]:
        """Rank ``rank`` of the producer at ``address`` when its cached handshake can be trusted
        (see :meth:`fetch_peer`), else None. Never does I/O."""
        where = self.peer_address(address, rank, tp_size)
        with self.lock:
            peer = self._peer_by_address.get(where)
        if (
            peer is not None
            and time.monotonic() - peer.seen <= self.config.handshake_ttl_s
            and (engine_id is None or peer.meta.engine_id == engine_id)
            and (instance_id is None or peer.meta.instance == instance_id)
        ):
            return peer
        return None

    def submits_async(self, peer: Peer) -> bool:
        """Whether a batch towards ``peer`` returns as soon as it is queued (XGMI: a kernel launch).

        TCP sends its bytes from the submitting thread, so only XGMI batches may be submitted
        from a thread that must not block (the control thread). Cached per peer.
        """
        hit = self._async_peers.get(peer.key)
        if hit is None:
            hit = {self.engine.route_of(a, b) for a in self.regions for b in peer.regions} == {BackendType.XGMI}
            with self.lock:  # threads of both sides ask; evict the oldest beyond _MAX_PEERS
                if len(self._async_peers) >= _MAX_PEERS:
                    self._async_peers.pop(next(iter(self._async_peers)))
                self._async_peers[peer.key] = hit
        return hit

    def doorbell_of(self, peer: Peer) -> Optional[DoorbellRing]:
        """``peer``'s doorbell board when it is on this host and can be opened, else None.

        Opened once per peer process; a board that cannot be opened (another host, another
        /dev/shm) is remembered as None, and that peer gets control messages only.
        """
        if not peer.meta.doorbell or not self.config.same_host_signals:
            return None
        with self.lock:
            if peer.key in self._rings:
                return self._rings[peer.key]
        try:
            ring: Optional[DoorbellRing] = DoorbellRing(peer.meta.doorbell, peer.key)
        except DoorbellError as e:
            logger.info("MoriSuiteConnector: no doorbell towards %s (control messages only): %s", peer.key, e)
            ring = None
        with self.lock:
            if peer.key in self._rings:  # another thread opened it meanwhile
                if ring is not None:
                    ring.close()
                return self._rings[peer.key]
            if len(self._rings) >= _MAX_PEERS:
                old = self._rings.pop(next(iter(self._rings)))
                if old is not None:
                    old.close()
            self._rings[peer.key] = ring
        return ring

    def confirm(self, peers: Sequence[Peer]) -> None:
        """These peers just proved alive (a transfer with them succeeded)."""
        now = time.monotonic()
        with self.lock:
            for peer in peers:
                peer.seen = now

    def forget(self, address: Address, key: Optional[str] = None) -> None:
        """Drop the cached handshake at ``address`` (only if it is engine ``key``, when given).

        The next request there handshakes again and so finds a restarted server.
        """
        with self.lock:
            peer = self._peer_by_address.get(address)
            if peer is not None and (key is None or peer.key == key):
                del self._peer_by_address[address]

    def peer_routes(self) -> Dict[str, str]:
        """Which transport the engine uses towards each known peer (first KV region pair), by engine key."""
        with self.lock:
            peers = list(self._peers.values())
        return {p.key: str(self.engine.route_of(self.regions[0], p.regions[0]).name) for p in peers}

    # ------------------------------------------------------------- planning
    def group_positions(self, group: int, num_prompt_tokens: int) -> int:
        """Blocks holding the prompt in KV cache group ``group``."""
        return math.ceil(num_prompt_tokens / self.identity.group_block_sizes[group])

    def plan(
        self,
        peer: Peer,
        local_is_source: bool,
        blocks: Sequence[Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]],
        head_pairs: Sequence[Tuple[int, int]],
        layer_names: Optional[Sequence[str]] = None,
    ) -> TransferBatch:
        """One batch moving ``head_pairs`` of the given blocks for every (or the named) layer.

        ``blocks[g]`` is ``(local block ids, remote block ids)`` of group ``g``;
        ``head_pairs`` are ``(source head, destination head)`` (source = the producer).
        """
        batch = TransferBatch()
        if not head_pairs:
            return batch
        for (local_region, remote_region, group), prepared in self._region_pairs(peer, local_is_source, layer_names):
            if group >= len(blocks):
                continue
            local_blocks, remote_blocks = blocks[group]
            if local_is_source:
                segs = self.planner.plan(prepared, local_blocks, remote_blocks, head_pairs)
            else:
                remote_off, local_off, sizes = self.planner.plan(prepared, remote_blocks, local_blocks, head_pairs)
                segs = (local_off, remote_off, sizes)
            batch.add(self.regions[local_region], peer.regions[remote_region], segs)
        return batch

    def submit_layers(
        self,
        peer: Peer,
        local_is_source: bool,
        blocks: Sequence[Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]],
        head_pairs: Sequence[Tuple[int, int]],
        layer_names: Optional[Sequence[str]],
        transfer_id: str,
        into: List[TransferStatus],
    ) -> int:
        """Plan and submit (``batch_write`` when ``local_is_source``, else ``batch_read``) the named
        (or all) layers; appends the statuses to ``into`` as each call returns; returns the bytes.

        A large transfer over many layers is two plans and two engine calls: its lead layers
        (``lead_layers`` of the config; auto: :func:`~mori_integrations.common.segments.lead_units`)
        and then the rest, so the copy of the lead starts while the rest is still being planned
        and submitted. Stamps ``planned`` and ``submitted`` after each call (``transfer_id``).
        """
        names = list(layer_names) if layer_names is not None else self._layer_names
        lead = self._lead_layers(names, blocks, head_pairs)
        parts = [names[:lead], names[lead:]] if lead else [layer_names]  # None: the plan cache's key for all
        batches = []
        for part in parts:
            batch = self.plan(peer, local_is_source, blocks, head_pairs, part)
            self.trace.mark(transfer_id, "planned")
            batch.submit(self.engine, read=not local_is_source, into=into)
            self.trace.mark(transfer_id, "submitted")
            batches.append(batch)
        return sum(b.nbytes for b in batches)  # counted while the copy runs, not between its parts

    def _lead_layers(self, names: Sequence[str], blocks: Sequence[Tuple[npt.NDArray, npt.NDArray]],
                     head_pairs: Sequence[Tuple[int, int]]) -> int:
        """How many of ``names`` go in a first call of their own (0: one call)."""
        setting = self.config.lead_layers
        if setting == 0 or len(names) < 2:
            return 0
        if setting > 0:
            return min(setting, len(names) - 1)
        # Bytes estimated from this side's layouts: blocks x (bytes of one block's moved heads) x layers.
        layer = self._local_layers.get(names[0])
        if layer is None:
            return 0
        moved = sum(len(b[0]) for b in blocks) * layer.block_bytes * len(head_pairs) // max(1, layer.num_heads)
        return lead_units(len(names), moved * len(names))

    def _region_pairs(
        self, peer: Peer, local_is_source: bool, layer_names: Optional[Sequence[str]]
    ) -> List[Tuple[Tuple[int, int, int], PreparedLayers]]:
        """The named (or all) layers grouped per (local region, remote region, KV cache group), each
        group prepared for the planner: every layer of a region pair goes to the engine as one batch
        entry (one launch for the whole request). Cached per peer, direction and layer list (a
        peer's layers never change: a restarted peer is another key)."""
        key = (peer.key, local_is_source, None if layer_names is None else tuple(layer_names))
        hit = self._plan_groups.get(key)
        if hit is not None:
            return hit
        names = layer_names if layer_names is not None else self._layer_names
        grouped: Dict[Tuple[int, int, int], List[Tuple[LayerLayout, LayerLayout]]] = {}
        for name in names:
            local = self._local_layers[name]
            remote = peer.layers.get(name)
            if remote is None:
                raise PlanError(f"the peer has no KV cache layer {name} (different model or pipeline split?)")
            pair = (local, remote) if local_is_source else (remote, local)
            grouped.setdefault((local.region, remote.region, local.group), []).append(pair)
        out = [(k, self.planner.prepare(pairs)) for k, pairs in grouped.items()]
        if len(self._plan_groups) >= _MAX_PLAN_GROUPS:
            self._plan_groups.clear()
        self._plan_groups[key] = out
        return out

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop threads, close sockets, deregister memory and peers. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.watch is not None:
            self.watch.close()
        if self.control is not None:
            self.control.close()
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        producer = getattr(self, "producer", None)
        if producer is not None:
            producer.close()
        notifier = getattr(self, "notifier", None)
        if notifier is not None:
            notifier.close()
        if self.doorbells is not None:
            self.doorbells.close()
        for ring in self._rings.values():
            if ring is not None:
                ring.close()
        for desc in getattr(self, "regions", []):
            try:
                self.engine.deregister_memory(desc)
            except Exception:
                logger.exception("deregister_memory failed during shutdown")
        self.ctx.destroy(linger=0)
