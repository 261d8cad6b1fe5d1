"""Prefill side: plan one chunk of a request into writes, submit them, wait, conclude.

Mixed into :class:`~mori_integrations.sglang.manager.MoriKVManager`. Chunks of one
room go to one shard queue (``room % shards``), so they stay in order while
different rooms transfer concurrently. A worker waits for its chunk with a
bounded deadline; completion of the last chunk is reported to decode through
SGLang's ``conclude_transfer`` (which never reports for MLA dummy ranks).

The data path of a chunk, :meth:`PrefillTransferMixin._write_chunk` (plan every layer's
K and V, state and aux of every decode target, one ``batch_write``, bounded wait), needs
no SGLang import: the GPU test and the benchmark drive it between two GPUs on a machine
without SGLang. Segments travel as int64 arrays; the engine moves all GPU pairs of the
batch (64 per-layer K/V buffers of a 32-layer model) with one launch.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np
import numpy.typing as npt

from mori_core.io import TransferStatus
from mori_integrations.common.segments import await_statuses, lead_units
from mori_integrations.sglang.peers import DecodePeer, RoomTarget, by_engine_key
from mori_integrations.sglang.plans import (
    PlanError,
    Segments,
    WriteBatch,
    as_indices,
    contiguous_segments,
    head_slice_segments,
    mamba_segments,
)

if TYPE_CHECKING:
    from sglang.srt.disaggregation.common.utils import TransferKVChunk

logger = logging.getLogger(__name__)

# State components SGLang 0.5.23 fills with page/slot indices copied item to item.
PAGED_STATE_TYPES = frozenset(
    {"swa", "dsa", "qsa_pending", "qsa_compressed", "swa_ring", "c128_state", "minimax_index_k", "minimax_dense_kv"}
)
# Position- or request-indexed components: a length mismatch would misalign rows.
STRICT_LENGTH_STATE_TYPES = frozenset({"qsa_pending", "qsa_compressed", "swa_ring", "c128_state", "minimax_dense_kv"})


class PrefillTransferMixin:
    """Transfer workers of a prefill-mode manager (see module docstring)."""

    _stop: threading.Event
    # A large chunk is submitted in two calls, lead pairs first (_submit_chunk); the benchmark turns
    # it off to compare in the same run.
    lead_split: bool = True
    last_lead: int = 0  # lead pairs of the last chunk written (0: one call); tests read it

    def _start_transfer_workers(self, shards: int, transfer_timeout_s: float, poll_ms: int) -> None:
        self._transfer_timeout_s = transfer_timeout_s
        self._wait_poll_ms = max(1, poll_ms)
        self._queues: List["queue.Queue[Optional[TransferKVChunk]]"] = [queue.Queue() for _ in range(shards)]
        for shard, q in enumerate(self._queues):
            self._start_thread(lambda q=q: self._transfer_worker(q), f"mori-suite-xfer-tp{self.attn_tp_rank}-s{shard}")

    # ------------------------------------------------------------ SGLang hook
    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
        *,
        wait_event: Optional[object] = None,
        indices_event: Optional[object] = None,
        trace_ctx: object = None,
    ) -> None:
        """Called by ``CommonKVSender.send`` (scheduler thread): queue one chunk, never block."""
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.utils import TransferKVChunk

        status = self.request_status.get(bootstrap_room)
        if status is None or status == KVPoll.Failed:
            return
        if bootstrap_room not in self.transfer_infos:
            self.conclude_failure(
                bootstrap_room=bootstrap_room,
                failure_reason="no destination metadata from decode for this request",
            )
            return
        self._queues[bootstrap_room % len(self._queues)].put(
            TransferKVChunk(
                room=bootstrap_room,
                prefill_kv_indices=kv_indices,
                index_slice=index_slice,
                is_last_chunk=is_last_chunk,
                prefill_aux_index=aux_index,
                state_indices=state_indices,
                num_kv_tokens=num_kv_tokens,
                wait_event=wait_event,
                indices_event=indices_event,
            )
        )

    # ---------------------------------------------------------------- worker
    def _transfer_worker(self, q: "queue.Queue[Optional[TransferKVChunk]]") -> None:
        while not self._stop.is_set():
            chunk = q.get()
            if chunk is None:  # teardown sentinel
                return
            try:
                self._transfer_chunk(chunk)
            except Exception as e:  # never let one request kill the shard
                logger.exception("mori-suite transfer worker failed for room %s", chunk.room)
                try:
                    self.conclude_failure(bootstrap_room=chunk.room, failure_reason=f"transfer worker error: {e!r}")
                except Exception:
                    logger.exception("could not report the failure of room %s", chunk.room)

    def _room_inactive(self, room: int) -> bool:
        from sglang.srt.disaggregation.base.conn import KVPoll

        status = self.request_status.get(room)
        return status is None or status == KVPoll.Failed

    def _claim_targets(self, room: int) -> Optional[List[Tuple[RoomTarget, Optional[DecodePeer]]]]:
        from sglang.srt.disaggregation.base.conn import KVPoll

        with self.transfer_lock:
            if self._room_inactive(room):
                return None
            infos = self.transfer_infos.get(room)
            if not infos:
                return []
            self.update_status(room, KVPoll.Transferring)
            return [(info, self.decode_kv_args_table.get(info.engine_key)) for info in by_engine_key(infos)]

    def _transfer_chunk(self, chunk: "TransferKVChunk") -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        room = chunk.room
        if self._room_inactive(room):
            return
        self._await_chunk_inputs(chunk)
        targets = self._claim_targets(room)
        if targets is None:
            return
        if not targets:
            self.conclude_failure(bootstrap_room=room, failure_reason="destination metadata of the request vanished")
            return
        quiescent = True
        self._outstanding_begin(room)
        try:
            failure, quiescent = self._write_chunk(chunk, targets)
        finally:
            if not quiescent:
                # Writes may still land in decode pages: never ack an ABORT for this room,
                # so decode keeps the pages until its own release timeout.
                with self._abort_ack_lock:
                    self.poison_deferred_ack_room(room)
            self._outstanding_end(room)
        if failure is not None:
            self.conclude_failure(bootstrap_room=room, failure_reason=failure)
        elif chunk.is_last_chunk and not self._room_inactive(room):
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)

    @staticmethod
    def _await_chunk_inputs(chunk: "TransferKVChunk") -> None:
        """Wait for what an early send still computes on the GPU (the KV, the page indices)."""
        if chunk.wait_event is not None:  # early send: KV still being computed on the GPU
            chunk.wait_event.synchronize()
        if chunk.indices_event is not None:  # page indices still being copied to the host
            chunk.indices_event.synchronize()

    def _write_chunk(
        self, chunk: "TransferKVChunk", targets: List[Tuple[RoomTarget, Optional[DecodePeer]]]
    ) -> Tuple[Optional[str], bool]:
        """Plan, submit (one ``batch_write``) and wait for one chunk's writes to every target.

        Returns ``(failure reason or None, quiescent)``; ``quiescent`` is False only when the
        wait's bound passed with writes still in flight. Adds the bytes to ``bytes_sent``.
        """
        statuses: List[TransferStatus] = []
        try:
            batch = self._plan_chunk(chunk, targets)
            self.last_lead = self._submit_chunk(chunk, batch, statuses)
            failure, quiescent = self._await_statuses(statuses)
            self.bytes_sent += batch.nbytes if failure is None else 0
            return failure, quiescent
        except PlanError as e:
            return f"KV layout of prefill and decode cannot be paired: {e}", True
        except Exception as e:
            logger.exception("mori-suite transfer submission failed for room %s", chunk.room)
            # A lead part submitted before the failure is in flight: the chunk ends when it does.
            _, quiescent = self._await_statuses(statuses)
            return f"transfer submission failed: {e!r}", quiescent

    def _submit_chunk(self, chunk: "TransferKVChunk", batch: WriteBatch, into: List[TransferStatus]) -> int:
        """Submit a planned chunk (statuses appended to ``into``): a large chunk over many region pairs
        in two calls, its lead pairs first (:func:`lead_units`), so their copy runs while the rest is
        submitted (over XGMI the call's host work is ~1.4 us per pair: ~90 us for 66 pairs).
        Returns the number of lead pairs (0: one call)."""
        kv_bytes = len(chunk.prefill_kv_indices) * sum(self.kv_args.kv_item_lens)  # to one target: a lower bound
        lead = lead_units(len(batch), kv_bytes) if self.lead_split else 0
        batch.submit(self.engine, lead=lead, into=into)
        return lead

    def _await_statuses(self, statuses: List[TransferStatus]) -> Tuple[Optional[str], bool]:
        """(failure reason or None, whether every write has stopped) within the transfer timeout."""
        return await_statuses(self.engine, statuses, self._transfer_timeout_s, self._wait_poll_ms)

    # ------------------------------------------------- abort-ack bookkeeping
    def _outstanding_begin(self, room: int) -> None:
        with self._abort_ack_lock:
            self._staging_outstanding[room] += 1

    def _outstanding_end(self, room: int) -> None:
        targets = None
        with self._abort_ack_lock:
            self._staging_outstanding[room] -= 1
            if self._staging_outstanding[room] <= 0:
                self._staging_outstanding.pop(room, None)
                if room not in self._deferred_ack_poisoned_rooms:
                    targets = self._deferred_ack_targets.pop(room, None)
        self._send_abort_acks(room, targets)

    # -------------------------------------------------------------- planning
    def _plan_chunk(self, chunk: "TransferKVChunk", targets: List[Tuple[RoomTarget, Optional[DecodePeer]]]) -> WriteBatch:
        batch = WriteBatch()
        src_pages = as_indices(chunk.prefill_kv_indices)
        for info, peer in targets:
            if info.is_dummy:
                continue
            if peer is None:
                raise PlanError(f"decode engine {info.engine_key} sent metadata but never registered")
            if peer.rejected:
                raise PlanError(peer.rejected)
            dst_pages = info.dst_pages[chunk.index_slice]
            if dst_pages.size != src_pages.size:
                raise PlanError(
                    f"chunk has {src_pages.size} prefill pages but decode allocated {dst_pages.size} "
                    f"for positions {chunk.index_slice.start}..{chunk.index_slice.stop}"
                )
            self._plan_kv(batch, peer, src_pages, dst_pages)
            if not chunk.is_last_chunk:
                continue
            if chunk.state_indices is not None and self.state_descs:
                self._plan_state(batch, peer, chunk.state_indices, info.state_indices)
            if chunk.prefill_aux_index is not None and info.aux_index >= 0 and self.pp_group.is_last_rank:
                self._plan_aux(batch, peer, int(chunk.prefill_aux_index), info.aux_index)
        return batch

    def _plan_kv(self, batch: WriteBatch, peer: DecodePeer, src: npt.NDArray, dst: npt.NDArray) -> None:
        if src.size == 0:
            return
        dst_lens = peer.registration.kv_item_lens
        cache: Dict[Tuple[int, int], Segments] = {}  # same page sizes => same segments for every layer
        for i, j in peer.kv_pairs:
            key = (self.kv_args.kv_item_lens[i], dst_lens[j])
            segments = cache.get(key)
            if segments is None:
                if peer.head_slice is None:
                    segments = contiguous_segments(src, dst, *key, as_lists=False)
                else:
                    segments = head_slice_segments(src, dst, self.kv_args.page_size, key[0], key[1], peer.head_slice)
                cache[key] = segments
            batch.add(self.kv_descs[i], peer.kv_descs[j], segments)

    def _plan_aux(self, batch: WriteBatch, peer: DecodePeer, src_row: int, dst_row: int) -> None:
        # Buffers pair positionally; a count mismatch was reported at registration.
        for k in range(min(len(self.aux_descs), len(peer.aux_descs))):
            item = self.kv_args.aux_item_lens[k]
            if peer.registration.aux_item_lens[k] != item:
                raise PlanError(f"metadata buffer {k}: prefill row {item} B, decode row {peer.registration.aux_item_lens[k]} B")
            batch.add(self.aux_descs[k], peer.aux_descs[k], ([src_row * item], [dst_row * item], [item]))

    def _plan_state(self, batch: WriteBatch, peer: DecodePeer, src_state: List, dst_state: List) -> None:
        reg = peer.registration
        for c, state_type in enumerate(self.kv_args.state_types):
            st = str(getattr(state_type, "value", state_type))
            src = src_state[c] if c < len(src_state) else None
            dst = dst_state[c] if c < len(dst_state) else None
            if src is None or dst is None:
                continue
            src, dst = as_indices(src), as_indices(dst)
            if src.size == 0 or dst.size == 0:
                continue
            src_lens = self.kv_args.state_item_lens[c]
            dst_lens = reg.state_item_lens[c]
            pairs = peer.state_pairs[c]
            if st == "mamba":
                self._plan_mamba(batch, peer, c, src, dst, pairs)
                continue
            if st not in PAGED_STATE_TYPES:
                raise PlanError(f"state type {st!r} is not supported by mori-suite's SGLang adapter")
            self._check_paged_state_tp(st, reg.attn_tp_size)
            if src.size != dst.size:
                if st in STRICT_LENGTH_STATE_TYPES:
                    raise PlanError(f"{st} state index counts differ: prefill {src.size}, decode {dst.size}")
                n = min(src.size, dst.size)
                logger.warning("%s state index counts differ (prefill %d, decode %d); sending %d", st, src.size, dst.size, n)
                src, dst = src[:n], dst[:n]
            for i, j in pairs:
                if src_lens[i] == 0 or dst_lens[j] == 0:  # elided (0-row) region on either side
                    continue
                batch.add(self.state_descs[c][i], peer.state_descs[c][j], contiguous_segments(src, dst, src_lens[i], dst_lens[j]))

    def _check_paged_state_tp(self, st: str, peer_tp: int) -> None:
        if st == "swa" and not self.is_mla_backend and peer_tp != self.attn_tp_size:
            raise PlanError(
                f"SWA state of a non-MLA model needs equal attention TP (prefill {self.attn_tp_size}, decode {peer_tp})"
            )
        if st in ("qsa_pending", "qsa_compressed", "minimax_index_k", "minimax_dense_kv"):
            src_tp = self.state_tp_size if st.startswith("qsa") else self.attn_tp_size
            if peer_tp != src_tp:
                raise PlanError(f"{st} state needs equal TP on both sides (prefill {src_tp}, decode {peer_tp})")

    def _plan_mamba(self, batch: WriteBatch, peer: DecodePeer, c: int, src: npt.NDArray, dst: npt.NDArray, pairs) -> None:
        if src.size != 1 or dst.size != 1:
            raise PlanError(f"Mamba state needs one slot per request, got prefill {src.size}, decode {dst.size}")
        reg = peer.registration
        src_dims = self.kv_args.state_dim_per_tensor[c] if c < len(self.kv_args.state_dim_per_tensor) else []
        dst_dims = reg.state_dim_per_tensor[c] if c < len(reg.state_dim_per_tensor) else []
        tp_mismatch = reg.attn_tp_size != self.state_tp_size and bool(src_dims) and bool(dst_dims)
        if tp_mismatch and 0 in src_dims:
            raise PlanError("replicated Mamba state needs equal prefill/decode attention TP")
        for i, j in pairs:
            tp_slice = None
            if tp_mismatch:
                groups = self.kv_args.state_conv_shard_groups[c] if c < len(self.kv_args.state_conv_shard_groups) else []
                outer = self.kv_args.state_slice_outer_counts[c] if c < len(self.kv_args.state_slice_outer_counts) else []
                tp_slice = dict(
                    src_dim=src_dims[i],
                    dst_dim=dst_dims[j],
                    outer_count=outer[i] if i < len(outer) else 1,
                    src_attn_tp_size=self.state_tp_size,
                    dst_attn_tp_size=reg.attn_tp_size,
                    dst_tp_rank_in_group=reg.attn_tp_rank % reg.attn_tp_size,
                    local_tp_rank_in_group=self.kv_args.engine_rank % self.state_tp_size,
                    conv_shard_groups=groups[i] if i < len(groups) else None,
                )
            segments = mamba_segments(
                int(src[0]), int(dst[0]), self.kv_args.state_item_lens[c][i], reg.state_item_lens[c][j], tp_slice
            )
            batch.add(self.state_descs[c][i], peer.state_descs[c][j], segments)
