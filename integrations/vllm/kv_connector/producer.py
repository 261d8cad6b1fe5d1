"""Producer (prefill) side of a worker: write KV into consumers, hold blocks until they are done.

Per request (``transfer_id``) a :class:`_Send` collects what the scheduler told us (the
request's blocks, that its last prompt chunk runs in this step, that it finished) and
what consumer ranks told us (WRITE: where to write; READ: that they have read). Writes
are layer-pipelined: while the step that computes the last prompt chunk runs, each
layer's blocks are queued to the writer thread right after the layer's attention saved
them (on a GPU behind a CUDA event recorded at that point, so the copy never overtakes
the kernel that produced the KV); a consumer that asks later gets all layers at once.
The writer never waits for a copy: it waits for the layer's event, plans the layer
(a cached template, see :class:`~.planner.LayerPlanner`) and submits it; queued layers of
one target whose events already completed (the writer fell behind the forward) go out as
one submission, so a burst costs one launch, not one per layer. A consumer that asks after
the KV is complete, over XGMI (where submitting only queues a copy), is written from the
control thread that received its request, with no hand-off to the writer.
The request's blocks are released (``finished_sending``) only when every consumer rank
is accounted for and no write is in flight, or ``defer_timeout`` after it finished.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import numpy.typing as npt

from mori_integrations.common.segments import PlanError, await_statuses
from mori_integrations.vllm.kv_connector.control import HandshakeError
from mori_integrations.vllm.kv_connector.messages import AgentMetadata, ConsumerDone, WriteDone, WriteRequest
from mori_integrations.vllm.kv_connector.metadata import FinishedSend, SendJob
from mori_integrations.vllm.kv_connector.planner import pair_blocks
from mori_integrations.vllm.kv_connector.tp_mapping import cached_head_pairs

if TYPE_CHECKING:
    from mori_integrations.common.doorbell import DoorbellRing
    from mori_integrations.vllm.kv_connector.agent import Peer, TransferAgent

__all__ = ["ProducerSide"]

logger = logging.getLogger(__name__)

_MAX_CLOSED = 1 << 16


@dataclasses.dataclass
class _Target:
    """One consumer rank that asked for writes (``consumer``: its decoded metadata, kept at hand)."""

    request: WriteRequest
    consumer: AgentMetadata
    peer: "Peer"
    budget_end: float
    enqueued: Set[str] = dataclasses.field(default_factory=set)
    final_enqueued: bool = False
    statuses: List[Any] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    started: Optional[float] = None
    failure: Optional[str] = None
    abort: Optional[str] = None
    ended: bool = False
    blocks: Optional[List[Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]] = None
    pairs: Optional[Sequence[Tuple[int, int]]] = None
    bell: Optional[DoorbellRing] = None  # the consumer's doorbell board, when it is on this host

    @property
    def rank(self) -> int:
        return self.consumer.tp_rank

    @property
    def writing(self) -> bool:
        return bool(self.enqueued or self.final_enqueued) and not self.ended


@dataclasses.dataclass
class _Send:
    transfer_id: str
    created: float
    job: Optional[SendJob] = None
    kv_ready: bool = False
    ready_event: Any = None  # CUDA event recorded when the last prompt chunk was computed
    finished: Optional[FinishedSend] = None
    finished_at: float = 0.0
    expected: Optional[int] = None  # consumer TP size
    accounted: Set[int] = dataclasses.field(default_factory=set)
    targets: Dict[int, _Target] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _WriteItem:
    send: _Send
    target: _Target
    layers: List[str]
    event: Any  # CUDA event the layers' KV is complete behind, or None
    final: bool
    more_events: List[Any] = dataclasses.field(default_factory=list)  # of items merged into this one

    def ready(self) -> bool:
        """The KV is computed (no wait needed)."""
        return self.event is None or bool(self.event.query())

    def absorb(self, other: "_WriteItem") -> None:
        """Take the layers of a later item of the same target."""
        self.layers = self.layers + other.layers
        self.more_events.append(other.event)
        self.final = self.final or other.final


class ProducerSide:
    """See the module docstring. All methods are thread-safe."""

    def __init__(self, agent: "TransferAgent") -> None:
        self._agent = agent
        self._sends: Dict[str, _Send] = {}
        # Recently finished transfers: a late write request gets an immediate refusal instead of
        # leaving its decode waiting for recv_abort_timeout.
        self._closed: "collections.OrderedDict[str, Tuple[float, str]]" = collections.OrderedDict()
        self._step: List[_Send] = []  # sends whose last prompt chunk runs in the current step
        self._layer_names = [layer.name for layer in agent.layers]
        self._pending: "collections.deque[Optional[_WriteItem]]" = collections.deque()
        self._pending_cv = threading.Condition()
        self._writer = threading.Thread(target=self._writer_loop, name="mori-kv-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------ scheduler-side events
    def begin_step(self, jobs: Sequence[SendJob], finished: Sequence[FinishedSend]) -> None:
        """This step's last-chunk requests and newly finished requests (model thread, before the forward)."""
        now = time.monotonic()
        with self._agent.lock:
            for job in jobs:
                send = self._get(job.transfer_id, now)
                send.job = job
                self._step.append(send)
            for note in finished:
                send = self._sends.get(note.transfer_id)
                if send is None:
                    if not note.blocks_held:
                        self._close(note.transfer_id, "the prefill request was aborted", now)
                    continue
                if not note.blocks_held:  # freed by the scheduler: nobody may read or write them any more
                    self._fail_waiting(send, "the prefill request was aborted")
                    self._close(note.transfer_id, "the prefill request was aborted", now)
                    continue
                send.finished, send.finished_at = note, now
                if note.aborted:
                    self._fail_waiting(send, "the prefill request was aborted")

    def on_layer_saved(self, layer_name: str, kv_layer: Any) -> None:
        """A layer's KV of this step is computed (called from vLLM's attention, model thread)."""
        if not self._step:
            return
        event = _cuda_event(kv_layer)
        with self._agent.lock:
            for send in self._step:
                for target in send.targets.values():
                    if target.abort is None and not target.final_enqueued and layer_name not in target.enqueued:
                        target.enqueued.add(layer_name)
                        self._put(_WriteItem(send, target, [layer_name], event, final=False))

    def end_step(self, kv_tensor: Any = None) -> None:
        """The step's forward is enqueued: every last-chunk request's KV is complete (model thread)."""
        if not self._step:
            return
        event = _cuda_event(kv_tensor)
        with self._agent.lock:
            for send in self._step:
                send.kv_ready, send.ready_event = True, event
                for target in send.targets.values():
                    self._enqueue_rest(send, target, event)
            self._step = []
        if self._agent.control is not None:  # the decodes' write requests may come any moment now
            self._agent.control.expect()

    # --------------------------------------------------- consumer messages
    def on_write_request(self, request: WriteRequest) -> None:
        """WRITE mode: a consumer rank says where to write (control thread)."""
        self._agent.trace.mark(request.transfer_id, "write_request_received")
        consumer = request.consumer_meta
        if request.producer_key and request.producer_key != self._agent.engine_key:
            # Meant for the process that had these ports before us: it held the request, we never will.
            self._reply(consumer.notify_host, consumer.notify_port, request.transfer_id, False, 0, 0,
                        f"the write request was for prefill engine {request.producer_key}, this is "
                        f"{self._agent.engine_key} (the prefill restarted)")
            return
        try:
            peer = self._agent.peer_from_meta(consumer)
            bell = self._agent.doorbell_of(peer) if request.doorbell_slot >= 0 else None
        except (HandshakeError, ValueError, RuntimeError) as e:
            logger.warning("MoriSuiteConnector: write request for %s refused: %s", request.transfer_id, e)
            self._reply(consumer.notify_host, consumer.notify_port, request.transfer_id, False, 0, 0, str(e))
            return
        now = time.monotonic()
        with self._agent.lock:
            closed = self._closed_reason(request.transfer_id, now)
            if closed is not None:
                self._reply(consumer.notify_host, consumer.notify_port, request.transfer_id, False, 0, 0, closed)
                return
            send = self._get(request.transfer_id, now)
            send.expected = consumer.tp_size
            if consumer.tp_rank in send.targets:
                logger.warning("MoriSuiteConnector: duplicate write request for %s ignored", request.transfer_id)
                return
            if consumer.tp_rank in send.accounted:
                # That rank already said it needs nothing more (its abort overtook this request: they
                # may take different wires, see common.local_inbox). It waits for a WriteDone.
                self._reply(consumer.notify_host, consumer.notify_port, request.transfer_id, False, 0, 0,
                            "the decode rank had already released this request")
                return
            target = _Target(request=request, consumer=consumer, peer=peer,
                             budget_end=now + request.budget_ms / 1000.0, bell=bell)
            send.targets[consumer.tp_rank] = target
            if send.finished is not None and send.finished.aborted:
                target.abort = "the prefill request was aborted"
                self._end_target(send, target)
                return
            if not send.kv_ready:
                return  # the writes start when the request's last chunk is computed
            item = self._rest_item(send, target, send.ready_event)
        # The KV is computed: this target's whole write is this one item (no other item of it can
        # exist, so it may skip the queue). Where submitting cannot block (XGMI) and the KV is
        # complete, it is written right here: handing it to the writer thread cost a thread
        # wake-up (~150 us on an idle host) between the request and the copy.
        if item is None:
            return
        if item.ready() and self._agent.submits_async(peer):
            self._run_item(item)
        else:
            self._put(item)

    def on_consumer_done(self, note: ConsumerDone) -> None:
        """A consumer rank needs nothing more (READ finished, released, or aborted) (control thread)."""
        if note.producer_key and note.producer_key != self._agent.engine_key:
            return  # about our predecessor's copy of the request, not ours
        now = time.monotonic()
        with self._agent.lock:
            if self._closed_reason(note.transfer_id, now) is not None:
                return
            send = self._get(note.transfer_id, now)
            send.expected = note.consumer_tp
            target = send.targets.get(note.consumer_rank)
            if note.nbytes:
                self._agent.counters.add("bytes_served", note.nbytes)
            if target is None:
                send.accounted.add(note.consumer_rank)
                return
            # WRITE-mode abort: stop writing; the consumer frees its blocks after our WriteDone.
            target.abort = note.reason or "the decode request was aborted"
            if not target.writing:
                self._end_target(send, target)

    # ---------------------------------------------------- completion, GC
    def take_finished(self) -> Set[str]:
        """Request ids whose blocks the scheduler may free now (model thread, every step)."""
        now = time.monotonic()
        done: Set[str] = set()
        cfg = self._agent.config
        with self._agent.lock:
            for tid, send in list(self._sends.items()):
                if any(t.writing for t in send.targets.values()):
                    continue
                if send.finished is None:
                    # Messages for a request this server never ran (or not yet): keep them a while.
                    if send.job is None and now - send.created > cfg.defer_timeout_s + cfg.write_budget_s():
                        self._fail_waiting(send, "the prefill server has no such request")
                        self._close(tid, "the prefill server has no such request", now)
                    continue
                complete = send.expected is not None and len(send.accounted) >= send.expected
                expired = now - send.finished_at > cfg.defer_timeout_s
                if complete or send.finished.aborted or expired:
                    if expired and not complete and not send.finished.aborted:
                        logger.warning(
                            "MoriSuiteConnector: request %s: %s of %s decode ranks took its KV within defer_timeout "
                            "(%g s); freeing its blocks",
                            send.finished.req_id,
                            len(send.accounted),
                            send.expected if send.expected is not None else "?",
                            cfg.defer_timeout_s,
                        )
                        self._fail_waiting(send, "defer_timeout passed on the prefill")
                    done.add(send.finished.req_id)
                    self._close(tid, "the prefill already released this request's KV", now)
        return done

    def has_pending(self) -> bool:
        with self._agent.lock:
            return bool(self._sends)

    # ---------------------------------------------------------- internals
    def _get(self, transfer_id: str, now: float) -> _Send:
        send = self._sends.get(transfer_id)
        if send is None:
            send = self._sends[transfer_id] = _Send(transfer_id=transfer_id, created=now)
        return send

    def _close(self, transfer_id: str, reason: str, now: float) -> None:
        """Forget a transfer, remembering (bounded, for a while) why late messages get refused (lock held)."""
        self._sends.pop(transfer_id, None)
        cfg = self._agent.config
        self._closed[transfer_id] = (now + cfg.defer_timeout_s + cfg.write_budget_s(), reason)
        self._closed.move_to_end(transfer_id)
        while len(self._closed) > _MAX_CLOSED or next(iter(self._closed.values()))[0] < now:
            self._closed.popitem(last=False)
            if not self._closed:
                break

    def _closed_reason(self, transfer_id: str, now: float) -> Optional[str]:
        item = self._closed.get(transfer_id)
        return None if item is None or item[0] < now else item[1]

    def _enqueue_rest(self, send: _Send, target: _Target, event: Any) -> None:
        item = self._rest_item(send, target, event)
        if item is not None:
            self._put(item)

    def _rest_item(self, send: _Send, target: _Target, event: Any) -> Optional[_WriteItem]:
        """The final write of ``target``: every layer not written yet (None: nothing more to write; lock held)."""
        if target.final_enqueued or target.abort is not None:
            return None
        rest = [n for n in self._layer_names if n not in target.enqueued]
        target.enqueued.update(rest)
        target.final_enqueued = True
        return _WriteItem(send, target, rest, event, final=True)

    def _fail_waiting(self, send: _Send, reason: str) -> None:
        for target in send.targets.values():
            if target.abort is None:
                target.abort = reason
            if not target.writing:
                self._end_target(send, target)

    def _end_target(self, send: _Send, target: _Target, elapsed_us: int = 0) -> None:
        """Mark a target ended (lock held) and tell the consumer rank."""
        if target.ended:
            return
        target.ended = True
        send.accounted.add(target.rank)
        ok = target.failure is None and target.abort is None
        reason = target.failure or target.abort or ""
        consumer = target.consumer
        if ok and target.bell is not None:  # first: the consumer sees it without any thread waking up
            try:
                target.bell.ring(target.request.doorbell_slot, target.request.doorbell_seq, target.nbytes, elapsed_us)
                self._agent.trace.mark(send.transfer_id, "doorbell_rung")
            except ValueError as e:  # a slot outside the board: the WriteDone below still tells it
                logger.warning("MoriSuiteConnector: doorbell of %s not rung: %s", send.transfer_id, e)
        self._agent.trace.mark(send.transfer_id, "write_done_sent")
        self._reply(consumer.notify_host, consumer.notify_port, send.transfer_id, ok, target.nbytes if ok else 0,
                    elapsed_us, reason)

    def _reply(self, host: str, port: int, transfer_id: str, ok: bool, nbytes: int, elapsed_us: int, reason: str) -> None:
        ident = self._agent.identity
        self._agent.notifier.send(
            host,
            port,
            WriteDone(
                transfer_id=transfer_id,
                producer_rank=ident.tp_rank,
                producer_tp=ident.tp_size,
                ok=ok,
                nbytes=nbytes,
                elapsed_us=elapsed_us,
                reason=reason[:4000],
                producer_key=self._agent.engine_key,
            ),
        )

    def _prepare(self, send: _Send, target: _Target) -> None:
        """Block pairs and head pairs of a target (lock held)."""
        if target.blocks is not None:
            return
        if send.job is None:
            raise PlanError("the request's blocks are unknown on the prefill")
        agent, req = self._agent, target.request
        ident, consumer = agent.identity, target.consumer
        if consumer.total_kv_heads != ident.total_kv_heads or consumer.replicated_heads != ident.replicated_heads:
            raise PlanError(
                f"KV heads differ: prefill {ident.total_kv_heads}, decode {consumer.total_kv_heads} (same model?)"
            )
        blocks = []
        for g, dst in enumerate(req.block_ids):
            if g >= len(send.job.block_ids):
                raise PlanError(f"decode sent blocks of KV cache group {g}; the prefill has {len(send.job.block_ids)}")
            start = req.positions[g]
            src = send.job.block_ids[g][start:]
            s, d = pair_blocks(src, dst, send.job.null_block_id)
            blocks.append((s, d))
        target.blocks = blocks
        target.pairs = cached_head_pairs(
            ident.total_kv_heads, ident.tp_size, ident.tp_rank, consumer.tp_size, consumer.tp_rank, ident.replicated_heads
        )

    def _put(self, item: Optional[_WriteItem]) -> None:
        with self._pending_cv:
            self._pending.append(item)
            self._pending_cv.notify()

    def _next_item(self) -> Optional[_WriteItem]:
        """The next write (None: stop), with the following queued items of the same target whose KV is ready."""
        with self._pending_cv:
            while not self._pending:
                self._pending_cv.wait()
            item = self._pending.popleft()
            while item is not None and self._pending:
                nxt = self._pending[0]
                if nxt is None or nxt.target is not item.target or nxt.send is not item.send or not nxt.ready():
                    break
                item.absorb(self._pending.popleft())
            return item

    def _writer_loop(self) -> None:
        while True:
            item = self._next_item()
            if item is None:
                return
            self._run_item(item)

    def _run_item(self, item: _WriteItem) -> None:
        """Write one item; a failure is recorded on its target (never raised: the caller is a service thread)."""
        try:
            self._write(item)
        except Exception as e:
            logger.exception("MoriSuiteConnector: write of %s failed", item.send.transfer_id)
            with self._agent.lock:
                item.target.failure = item.target.failure or f"write error: {e!r}"
            if item.final:
                self._agent.pool.submit(self._finish, item.send, item.target)

    def _write(self, item: _WriteItem) -> None:
        send, target = item.send, item.target
        for event in [item.event] + item.more_events:
            if event is not None:
                event.synchronize()
        agent = self._agent
        trace = agent.trace
        trace.mark(send.transfer_id, "write_begin")
        with agent.lock:
            skip = target.abort is not None or target.failure is not None
            if not skip and time.monotonic() > target.budget_end:
                target.failure = "the decode's deadline for this request passed before the prefill could write"
                skip = True
            if not skip:
                try:
                    self._prepare(send, target)
                except PlanError as e:
                    target.failure = f"KV layouts of prefill and decode cannot be paired: {e}"
                    skip = True
        if not skip:
            trace.mark(send.transfer_id, "prepared")
            t_submit = time.monotonic()  # TCP sends from this thread inside submit(): time it from here
            statuses: List[Any] = []
            nbytes = 0
            try:
                nbytes = agent.submit_layers(target.peer, True, target.blocks, target.pairs, item.layers,
                                             send.transfer_id, statuses)
            finally:  # a lead part already submitted is in flight even when the rest failed: _finish waits for it
                with agent.lock:
                    target.started = target.started or t_submit
                    target.statuses.extend(statuses)
                    target.nbytes += nbytes
        if item.final:
            agent.pool.submit(self._finish, send, target)

    def _finish(self, send: _Send, target: _Target) -> None:
        agent = self._agent
        started = target.started or time.monotonic()
        remaining = agent.config.transfer_timeout_s - (time.monotonic() - started)
        agent.trace.mark(send.transfer_id, "finish_begin")
        reason, quiescent = await_statuses(agent.engine, target.statuses, max(0.001, remaining))
        agent.trace.mark(send.transfer_id, "statuses_done")
        if not quiescent:  # the engine ends every transfer within its own timeouts; wait for that
            reason_after, _ = await_statuses(agent.engine, target.statuses, agent.config.tcp_op_timeout_ms / 1000 + 5)
            reason = reason or reason_after
        elapsed_us = int((time.monotonic() - started) * 1e6)
        with agent.lock:
            if reason is not None and target.failure is None:
                target.failure = reason
            ok = target.failure is None and target.abort is None
            if ok:
                agent.counters.add("bytes_sent", target.nbytes)
                agent.counters.observe_ms(elapsed_us / 1000)
            self._end_target(send, target, elapsed_us)
        if not ok:
            logger.warning(
                "MoriSuiteConnector: KV writes of %s to decode rank %d ended without success: %s",
                send.transfer_id,
                target.rank,
                target.failure or target.abort,
            )

    def close(self) -> None:
        self._put(None)
        self._writer.join(timeout=2.0)


def _cuda_event(tensor: Any) -> Any:
    """A CUDA event recorded on the current stream when ``tensor`` lives on a GPU, else None."""
    if tensor is None or not getattr(tensor, "is_cuda", False):
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event
