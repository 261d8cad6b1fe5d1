"""``MoriKVManager``: SGLang's per-rank PD transfer manager on mori-suite's IO engine.

Built on SGLang 0.5.23's ``CommonKVManager``, which owns the protocol the decode
and prefill loops depend on (room status table, bootstrap registration, rank
mapping for different TP sizes, heartbeats, ABORT / ABORT_ACK bookkeeping). This
class adds what a backend must: an engine with registered memory, the control
threads that validate and apply peer messages, and (prefill) the transfer
workers of :mod:`~mori_integrations.sglang.prefill_transfer`.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Callable, List, Optional, Tuple

import numpy as np
import numpy.typing as npt
import zmq

from mori_core.io import MemoryDesc, MemoryLocationType
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG, ABORT_TAG, AbortNotification, CommonKVManager
from sglang.srt.disaggregation.common.staging_buffer import resolve_total_kv_heads
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_device
from sglang.srt.server_args import ServerArgs

from mori_integrations.common.log_limit import RateLimitedLog, zmq_peer_address
from mori_integrations.common.zmq_setup import bound_context
from mori_integrations.sglang import io_setup
from mori_integrations.sglang.bootstrap_auth import SignedRouteRegistration
from mori_integrations.sglang.messages import (
    MAX_FRAME_BYTES,
    STOCK_MORI_GUARD,
    ControlMessageError,
    KVStatus,
    PeerRegistration,
    TransferMetadata,
    check_frames,
    decode_message,
    encode_message,
    is_ours,
    truncate_reason,
)
from mori_integrations.sglang.peers import DecodePeer, RecentRooms, RoomTarget
from mori_integrations.sglang.plans import HeadSlice, PlanError, pair_entries
from mori_integrations.sglang.prefill_transfer import PrefillTransferMixin

logger = logging.getLogger(__name__)

IMPLEMENTATION = "mori-suite (mori_integrations.sglang)"
_RECV_POLL_MS = 250  # control threads wake this often to notice teardown


class MoriKVManager(SignedRouteRegistration, PrefillTransferMixin, CommonKVManager):
    """One per scheduler rank; see the module docstring."""

    supports_role_switch = True  # teardown() releases engine, memory, threads and sockets
    supports_deferred_decode_kv_release = True  # ABORT_ACK only once this rank's writes stopped
    reports_transfer_latency = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._warned_stock_peer = False
        self._bad_input = RateLimitedLog(logger, what="bad control messages")
        self.bytes_sent = 0

        self.kv_location = io_setup.kv_location(str(get_device().device))
        key = (
            f"sglang-{disaggregation_mode.value}-dp{self.system_dp_rank}-tp{self.attn_tp_rank}-"
            f"pp{self.pp_rank}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        setup = io_setup.create_engine_bounded(
            key,
            self.local_ip,
            gpu_memory=self.kv_location == MemoryLocationType.GPU,
            ib_device=args.ib_device or None,
            rdma=io_setup.RdmaTuning.from_env(),
        )
        self.engine = setup.engine
        self.engine_desc = self.engine.get_engine_desc()
        self._register_local_memory()

        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.transfer_lock = threading.Lock()
            self._abort_ack_lock = threading.Lock()
            self._early_failures = RecentRooms(ttl_s=max(60.0, float(self.bootstrap_timeout)))
            aux_note = io_setup.aux_rdma_note()
            if aux_note:
                logger.warning("MoriKVManager: %s", aux_note)
            shards = max(1, envs.SGLANG_MORI_TRANSFER_SHARDS.get())
            self._start_transfer_workers(shards, io_setup.transfer_timeout_s(), envs.SGLANG_MORI_WAIT_POLL_MS.get())
            self._start_thread(self._control_loop(self._on_prefill_message), f"mori-suite-ctl-p{self.attn_tp_rank}")
        else:
            self._start_thread(self._control_loop(self._on_decode_message), f"mori-suite-ctl-d{self.attn_tp_rank}")
            self._heartbeat_thread = self._start_heartbeat_checker_thread()
        logger.info(
            "MoriKVManager: implementation=%s role=%s engine=%s at %s:%d, IO backends: %s, "
            "KV memory: %s, control port %d",
            IMPLEMENTATION,
            disaggregation_mode.value,
            key,
            self.engine_desc.host,
            self.engine_desc.port,
            setup.describe(),
            self.kv_location.name,
            self.rank_port,
        )

    # SGLang binds server_socket inside CommonKVManager.__init__, and libzmq copies a
    # listener's MAXMSGSIZE / RCVHWM when it binds: a setsockopt afterwards does not reach
    # the connections it accepts. So the bounds become defaults of the context SGLang
    # creates for it, as it is assigned: a frame larger than any piece of a valid message
    # then drops the sending connection at the frame header.
    @property
    def _zmq_ctx(self) -> zmq.Context:
        return self.__dict__["_mori_zmq_ctx"]

    @_zmq_ctx.setter
    def _zmq_ctx(self, ctx: zmq.Context) -> None:
        bound_context(ctx, MAX_FRAME_BYTES)
        self.__dict__["_mori_zmq_ctx"] = ctx

    # ------------------------------------------------------------- memory
    def _register_local_memory(self) -> None:
        a = self.kv_args
        gpu_id = int(getattr(a, "gpu_id", 0) or 0)
        self.kv_descs: List[MemoryDesc] = io_setup.register_regions(
            self.engine, a.kv_data_ptrs, a.kv_data_lens, self.kv_location, gpu_id
        )
        # SGLang's metadata buffers live in host memory.
        self.aux_descs: List[MemoryDesc] = io_setup.register_regions(
            self.engine, a.aux_data_ptrs, a.aux_data_lens, MemoryLocationType.CPU, -1
        )
        self.state_descs: List[List[Optional[MemoryDesc]]] = [
            io_setup.register_regions(self.engine, ptrs, lens, self.kv_location, gpu_id)
            for ptrs, lens in zip(a.state_data_ptrs or [], getattr(a, "state_data_lens", None) or [])
        ]
        if any(d is None for d in self.kv_descs + self.aux_descs):
            raise ValueError("MoriKVManager: a KV or metadata buffer has length 0")

    # ------------------------------------------------------------ threads
    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _control_loop(self, handle: Callable[[List[bytes]], None]) -> Callable[[], None]:
        socket = self.server_socket
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)

        def loop() -> None:
            while not self._stop.is_set():
                self._bad_input.tick()
                try:
                    if not poller.poll(_RECV_POLL_MS):
                        continue
                    parts = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.ZMQError:
                    if self._stop.is_set():
                        return
                    logger.exception("mori-suite control socket error")
                    continue
                source = zmq_peer_address(parts)
                try:
                    handle([p.bytes for p in parts])
                except ControlMessageError as e:  # bad input: rate-limited, per source and in total
                    self._bad_input.warning(source, "mori-suite: rejected a control message from %s: %s", source, e)
                except Exception as e:  # a bad message must not end the thread
                    self._bad_input.warning(source, "mori-suite: failed to handle a control message from %s: %r",
                                            source, e)

        return loop

    def _warn_stock_peer(self) -> None:
        if not self._warned_stock_peer:
            self._warned_stock_peer = True
            logger.error(
                "mori-suite: a peer uses SGLang's in-tree mori backend (message guard %r). Both "
                "prefill and decode must run with mori-suite installed; its messages are dropped.",
                STOCK_MORI_GUARD,
            )

    # ---------------------------------------------------- prefill control
    def _on_prefill_message(self, frames: List[bytes]) -> None:
        if not frames:
            raise ControlMessageError("empty message")
        if is_ours(frames):
            message = decode_message(frames)
            if isinstance(message, PeerRegistration):
                self._register_peer(message)
            elif isinstance(message, TransferMetadata):
                self._accept_metadata(message)
            else:
                raise ControlMessageError(f"unexpected {type(message).__name__} on a prefill rank")
            return
        if frames[0] == STOCK_MORI_GUARD:
            self._warn_stock_peer()
            return
        check_frames(frames)
        if self.deferred_bootstrap is not None and self._handle_bootstrap_message(frames):
            return
        if frames[0] == ABORT_TAG:
            self._handle_decode_abort(frames)
            return
        raise ControlMessageError(f"unknown message tag {frames[0][:32]!r}")

    def _register_peer(self, reg: PeerRegistration) -> None:
        peer = DecodePeer.from_registration(reg)
        if peer.engine_key in self.decode_kv_args_table:
            return  # every decode request of a new connection re-registers; first one wins
        peer.rejected = self._pair_with(peer)
        if peer.rejected is None:
            self.engine.register_remote_engine(peer.engine_desc)
            self.check_peer_aux_buffer_count(peer.engine_key, len(reg.aux_descs))
            logger.debug("registered decode peer %s (%s:%d)", peer.engine_key, reg.endpoint, reg.rank_port)
        else:
            logger.error("decode peer %s cannot be served: %s", peer.engine_key, peer.rejected)
        self.decode_kv_args_table[peer.engine_key] = peer

    def _pair_with(self, peer: DecodePeer) -> Optional[str]:
        """Check layouts and precompute entry pairs; the reason when they cannot work together."""
        reg, a = peer.registration, self.kv_args
        if reg.page_size != a.page_size:
            return f"page size differs (prefill {a.page_size}, decode {reg.page_size})"
        if reg.is_mla != bool(self.is_mla_backend):
            return "one side uses an MLA KV cache and the other does not"
        if reg.kv_cache_dtype and a.kv_cache_dtype_str and reg.kv_cache_dtype != a.kv_cache_dtype_str:
            return f"KV cache dtype differs (prefill {a.kv_cache_dtype_str}, decode {reg.kv_cache_dtype})"
        if reg.dcp_size != self.dcp_size:
            return f"decode context parallelism ({self.dcp_size} -> {reg.dcp_size}) is not supported"
        local_types = [str(getattr(t, "value", t)) for t in a.state_types or []]
        if local_types != list(reg.state_types):
            return f"hybrid state components differ (prefill {local_types}, decode {list(reg.state_types)})"
        try:
            peer.kv_pairs = pair_entries(
                a.kv_layer_ids or [], reg.kv_layer_ids, len(self.kv_descs), len(peer.kv_descs)
            )
            peer.state_pairs = [
                pair_entries(
                    (a.state_layer_ids[c] if c < len(a.state_layer_ids or []) else []),
                    (reg.state_layer_ids[c] if c < len(reg.state_layer_ids) else []),
                    len(self.state_descs[c]),
                    len(peer.state_descs[c]),
                    allow_positional_fallback=self.pp_size == 1,
                )
                for c in range(len(self.state_descs))
            ]
        except PlanError as e:
            return f"layer layout: {e}"
        if not self.is_mla_backend and reg.attn_tp_size != self.attn_tp_size:
            peer.head_slice = HeadSlice.between(
                resolve_total_kv_heads(a, self.attn_tp_size),
                self.attn_tp_size,
                a.engine_rank,
                reg.attn_tp_size,
                reg.attn_tp_rank,
            )
        return None

    def _accept_metadata(self, meta: TransferMetadata) -> None:
        room = meta.room
        reply_failed: Optional[str] = None
        with self.transfer_lock:
            peer = self.decode_kv_args_table.get(meta.engine_key)
            status = self.request_status.get(room)
            early = self._early_failures.get(room)
            if peer is None:
                reply_failed = f"decode engine {meta.engine_key} is not registered with this prefill rank"
            elif peer.rejected:
                reply_failed = peer.rejected
            elif early is not None:
                reply_failed = early
            elif status == KVPoll.Failed:
                with self.failure_lock:
                    reply_failed = self.failure_records.get(room) or "request failed on the prefill side"
            elif status is not None and status != KVPoll.Bootstrapping:
                logger.debug("ignoring metadata for room %s in state %s", room, status)
                return
            if reply_failed is None:
                infos = self.transfer_infos.setdefault(room, {})
                infos[meta.engine_key] = RoomTarget.from_metadata(meta)
                if len(infos) >= meta.required_dst_info_num:
                    self.resolve_kv_replica_factor(infos)
                    self.req_to_decode_prefix_len[room] = max(i.decode_prefix_len for i in infos.values())
                    self.update_status(room, KVPoll.WaitingForInput)
                return
            if status is not None:
                self.record_failure(room, reply_failed)
                self.update_status(room, KVPoll.Failed)
            else:
                self._early_failures.add(room, reply_failed)
        self.send_kv_status_message(
            targets=[(meta.endpoint, meta.rank_port)],
            bootstrap_room=room,
            status=KVPoll.Failed,
            failure_reason=reply_failed,
        )

    def _handle_decode_abort(self, frames: List[bytes]) -> None:
        note = AbortNotification.from_zmq(frames)
        if note is None:
            return
        room = note.room
        with self.transfer_lock:
            status = self.request_status.get(room)
            if status is None:
                self._early_failures.add(room, "Aborted by the decode side")
            elif status not in (KVPoll.Success, KVPoll.Failed):
                self.record_failure(room, "Aborted by the decode side")
                self.update_status(room, KVPoll.Failed)
        target = note.deferred_ack_target() if self.enable_deferred_decode_kv_release else None
        if target is None:
            return
        with self._abort_ack_lock:
            if room in self._deferred_ack_poisoned_rooms:
                return
            if self._staging_outstanding.get(room, 0) > 0:
                self.register_deferred_ack_target(room, target)  # acked when the writes stop
                return
        self._send_abort_ack(room, target)

    def take_early_failure(self, room: int) -> Optional[str]:
        """Prefill: the reason a room failed before its sender existed (consumed)."""
        return self._early_failures.pop(room)

    def notify_prefill_abort(self, room: int, reason: str) -> None:
        """Prefill: tell the room's decode ranks that prefill aborted it."""
        with self.transfer_lock:
            targets = self._room_notify_targets(room)
            if not targets:
                self._early_failures.add(room, reason)  # metadata still to come gets Failed at once
        self.send_kv_status_message(targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)

    # ----------------------------------------------------- decode control
    def _on_decode_message(self, frames: List[bytes]) -> None:
        if not frames:
            raise ControlMessageError("empty message")
        if is_ours(frames):
            message = decode_message(frames)  # raises with the reason (the loop logs it, rate-limited)
            if not isinstance(message, KVStatus):
                raise ControlMessageError(f"unexpected {type(message).__name__} on a decode rank")
            self.apply_prefill_status(
                bootstrap_room=message.room,
                status=message.status,
                prefill_rank=message.prefill_rank,
                failure_reason=message.reason or None,
            )
            return
        if frames[0] == STOCK_MORI_GUARD:
            self._warn_stock_peer()
            return
        check_frames(frames)
        if self.handle_abort_ack_message(frames):
            return
        raise ControlMessageError(f"unknown message tag {frames[0][:32]!r}")

    # -------------------------------------------------- SGLang wire hooks
    def _encode_kv_status_message(
        self, *, bootstrap_room: int, status: KVPoll, failure_reason: Optional[str]
    ) -> List[bytes]:
        return encode_message(
            KVStatus(
                room=int(bootstrap_room),
                status=int(status),
                prefill_rank=self._prefill_unique_rank(),
                reason=truncate_reason(failure_reason),
            )
        )

    def parse_kv_status_message(self, msg: List[bytes]) -> Optional[Tuple[int, int, int, Optional[str]]]:
        try:
            message = decode_message(msg)
        except ControlMessageError as e:  # the control loop logs it (rate-limited) as bad input
            logger.debug("mori-suite: dropping status message: %s", e)
            return None
        if not isinstance(message, KVStatus):
            return None
        return message.room, message.status, message.prefill_rank, message.reason or None

    def build_receiver_registration_message(self) -> List[bytes]:
        a = self.kv_args
        return encode_message(
            PeerRegistration(
                endpoint=self.local_ip,
                rank_port=int(self.rank_port),
                engine_desc=self.engine_desc.pack(),
                kv_descs=[d.pack() for d in self.kv_descs],
                kv_item_lens=[int(x) for x in a.kv_item_lens],
                kv_layer_ids=[int(x) for x in (a.kv_layer_ids or [])],
                aux_descs=[d.pack() for d in self.aux_descs],
                aux_item_lens=[int(x) for x in a.aux_item_lens],
                state_types=[str(getattr(t, "value", t)) for t in a.state_types or []],
                state_descs=[[None if d is None else d.pack() for d in comp] for comp in self.state_descs],
                state_item_lens=[[int(x) for x in comp] for comp in a.state_item_lens or []],
                state_dim_per_tensor=[[int(x) for x in comp] for comp in getattr(a, "state_dim_per_tensor", None) or []],
                state_layer_ids=[[int(x) for x in comp] for comp in getattr(a, "state_layer_ids", None) or []],
                gpu_id=int(getattr(a, "gpu_id", 0) or 0),
                attn_tp_size=int(self.attn_tp_size),
                attn_tp_rank=int(a.engine_rank),
                page_size=int(a.page_size),
                is_mla=bool(self.is_mla_backend),
                dcp_size=int(self.dcp_size),
                dcp_rank=int(self.dcp_rank),
                kv_cache_dtype=str(a.kv_cache_dtype_str or ""),
            )
        )

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: npt.NDArray[np.int32],
        aux_index: Optional[int],
        state_indices: Optional[List],
        decode_prefix_len: Optional[int],
        is_dummy: bool,
        device_kv_indices: Optional[npt.NDArray[np.int32]] = None,
    ) -> List[bytes]:
        if is_dummy:
            pages, aux, states = b"", -1, []
        else:
            pages = np.ascontiguousarray(np.asarray(kv_indices).ravel(), dtype="<i4").tobytes()
            aux = -1 if aux_index is None else int(aux_index)
            states = [[] if s is None else np.asarray(s, dtype=np.int64).ravel().tolist() for s in state_indices or []]
        return encode_message(
            TransferMetadata(
                room=int(bootstrap_room),
                endpoint=self.local_ip,
                rank_port=int(self.rank_port),
                engine_key=self.engine_desc.key,
                kv_pages=pages,
                aux_index=aux,
                state_indices=states,
                required_dst_info_num=int(required_dst_info_num),
                decode_prefix_len=int(decode_prefix_len or 0),
                is_dummy=bool(is_dummy),
            )
        )

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """A KV checksum compares only when this rank receives what one prefill rank digested."""
        info = getattr(self, "prefill_info_table", {}).get(bootstrap_addr)
        return info is None or self.is_mla_backend or info.attn_tp_size == self.attn_tp_size

    # ------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Stop threads, close sockets, deregister memory and peers, drop the engine.

        The KV pools belong to the scheduler and are not freed. Safe to call twice.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        for q in getattr(self, "_queues", []):
            q.put(None)
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._heartbeat_shutdown.set()
            self._threads.append(self._heartbeat_thread)
        for t in self._threads:
            t.join(timeout=5.0)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            logger.warning("MoriKVManager teardown: threads still running: %s", alive)
        self._threads = []
        with self._socket_lock:
            for sock in list(self._socket_cache.values()) + list(self._monitor_cache.values()):
                sock.close(linger=0)
            self._socket_cache.clear()
            self._monitor_cache.clear()
        self.server_socket.close(linger=0)
        self._zmq_ctx.destroy(linger=0)
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            from sglang.srt.disaggregation.common.conn import CommonKVReceiver

            CommonKVReceiver.close_all_sockets()
        engine, self.engine = self.engine, None
        for desc in self.kv_descs + self.aux_descs + [d for comp in self.state_descs for d in comp]:
            if desc is not None:
                try:
                    engine.deregister_memory(desc)
                except Exception:
                    logger.exception("deregister_memory failed during teardown")
        for peer in list(getattr(self, "decode_kv_args_table", {}).values()):
            if peer.rejected is None:
                try:
                    engine.deregister_remote_engine(peer.engine_desc)
                except Exception:
                    logger.exception("deregister_remote_engine failed during teardown")
        self.kv_descs, self.aux_descs, self.state_descs = [], [], []
        logger.info("MoriKVManager torn down (role=%s)", self.disaggregation_mode.value)


__all__ = ["IMPLEMENTATION", "MoriKVManager"]
