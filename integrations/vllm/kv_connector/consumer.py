"""Consumer (decode) side of a worker: bring a request's prompt KV into its blocks.

Per request a :class:`_Recv` runs on a transfer thread: handshake with the producer's
ranks (cached, see :meth:`TransferAgent.fetch_peer`), then READ (pull the blocks with one
engine batch per producer rank, wait, tell every producer rank it may free them) or WRITE
(send every producer rank a :class:`WriteRequest`; the producer's :class:`WriteDone`
messages finish it, or, from a producer on this host, its doorbell (``common.doorbell``),
seen where vLLM polls (:meth:`ConsumerSide.take_results`) without any thread wake-up).
Every wait is bounded: a READ by ``transfer_timeout``; a WRITE by
``recv_abort_timeout``, after which no producer write can still start (their start budget
ends earlier) and none can still run (each ends within ``transfer_timeout`` of its start),
so the blocks may be reused. A WRITE whose producer process is gone (dead, or restarted on
the same ports: see :mod:`.peer_watch`) ends as soon as that is seen, since a gone process
writes nothing more. A request that fails is reported to vLLM (``failed_recving``), which
then recomputes it locally or fails it, per ``kv_load_failure_policy``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import msgspec
import numpy as np
import numpy.typing as npt

from mori_integrations.common.timer_slack import short_timer_slack
from mori_integrations.common.segments import PlanError, await_statuses
from mori_integrations.vllm.kv_connector.control import HandshakeError
from mori_integrations.vllm.kv_connector.messages import ConsumerDone, WriteDone, WriteRequest
from mori_integrations.vllm.kv_connector.metadata import RecvJob
from mori_integrations.vllm.kv_connector.peer_watch import PROBE_INTERVAL_S, Address
from mori_integrations.vllm.kv_connector.planner import pair_blocks
from mori_integrations.vllm.kv_connector.tp_mapping import cached_head_pairs

if TYPE_CHECKING:
    from mori_integrations.vllm.kv_connector.agent import Peer, TransferAgent

__all__ = ["ConsumerSide", "RecvResult"]

logger = logging.getLogger(__name__)

_POLL_S = 20e-6  # wait_ended's polling interval while a request is in flight


@dataclasses.dataclass(frozen=True)
class RecvResult:
    """How one request's KV arrived (or did not)."""

    req_id: str
    ok: bool
    aborted: bool
    mode: str
    nbytes: int
    transfer_ms: float  # engine time (READ: our reads; WRITE: the slowest producer rank's writes)
    wait_ms: float  # job start -> KV complete (WRITE: includes the prefill's compute)
    reason: str


@dataclasses.dataclass
class _Recv:
    job: RecvJob
    started: float
    deadline: float
    producers: Optional[List["Peer"]] = None  # index = producer rank
    addresses: List[Address] = dataclasses.field(default_factory=list)  # their handshake addresses
    requested: bool = False  # WRITE: write requests sent
    requested_at: float = 0.0
    abort_sent: bool = False  # WRITE: every producer was told to stop
    write_dones: Dict[int, WriteDone] = dataclasses.field(default_factory=dict)
    bells: List[Optional[Tuple[int, int]]] = dataclasses.field(default_factory=list)  # per producer rank: (slot, seq)
    aborted: bool = False
    result: Optional[RecvResult] = None


class ConsumerSide:
    """See the module docstring. All methods are thread-safe."""

    def __init__(self, agent: "TransferAgent") -> None:
        self._agent = agent
        self._recvs: Dict[str, _Recv] = {}  # transfer_id -> state
        self._ended = threading.Condition(agent.lock)  # notified when a request's outcome is recorded

    # ------------------------------------------------ scheduler-side events
    def start(self, jobs: Sequence[RecvJob]) -> None:
        """Start this step's jobs (model thread; never blocks)."""
        cfg = self._agent.config
        now = time.monotonic()
        for job in jobs:
            self._agent.trace.mark(job.transfer_id, "recv_start")
            if job.mode == "release":
                self._agent.pool.submit(self._release, job)
                continue
            recv = _Recv(job=job, started=now, deadline=now + cfg.recv_abort_timeout_s)
            with self._agent.lock:
                if job.transfer_id in self._recvs:  # two live requests under one id cannot be told apart
                    logger.warning("MoriSuiteConnector: transfer_id %s is already in use; request %s computes "
                                   "its prompt itself", job.transfer_id, job.req_id)
                    job = dataclasses.replace(job, transfer_id=f"{job.transfer_id}#dup-{job.req_id}", mode="invalid",
                                              error="transfer_id already in use by another request")
                    recv = _Recv(job=job, started=now, deadline=recv.deadline)
                self._recvs[job.transfer_id] = recv
                if job.mode == "invalid":
                    self._finish(recv, False, f"kv_transfer_params cannot drive a transfer: {job.error}")
                    continue
            # A WRITE whose producers' handshakes are cached needs no I/O before its request is
            # sent: it is sent from here. A hand-off to a transfer thread cost a thread wake-up
            # (~70-150 us on an idle host) before the request left.
            # A READ whose batches only queue copies (XGMI) is submitted from here too; a transfer
            # thread waits for it.
            known = self._cached_producers(job) if job.mode in ("write", "read") else None
            if known is not None and (job.mode == "write" or all(map(self._agent.submits_async, known[1]))):
                self._run(recv, known)
            else:
                self._agent.pool.submit(self._run, recv)

    def abort(self, req_ids: Set[str]) -> None:
        """vLLM finished (aborted) these requests: stop what can be stopped (model thread)."""
        if not req_ids:
            return
        with self._agent.lock:
            for recv in self._recvs.values():
                if recv.job.req_id in req_ids and recv.result is None and not recv.aborted:
                    recv.aborted = True
                    if recv.requested:
                        self._stop_writes(recv, "the decode request was aborted")

    def take_results(self) -> List[RecvResult]:
        """Requests whose KV transfer ended (model thread, every step)."""
        now = time.monotonic()
        out: List[RecvResult] = []
        with self._agent.lock:
            self._poll_bells()
            for tid, recv in list(self._recvs.items()):
                if recv.result is None and recv.requested and now > recv.deadline:
                    self._finish(recv, False, f"no KV from the prefill within recv_abort_timeout "
                                 f"({self._agent.config.recv_abort_timeout_s:g} s)")
                if recv.result is not None:
                    out.append(recv.result)
                    del self._recvs[tid]
        return out

    def has_pending(self) -> bool:
        with self._agent.lock:
            return bool(self._recvs)

    def wait_ended(self, timeout_s: float) -> bool:
        """Block (bounded) until some request's outcome is ready for :meth:`take_results`.

        vLLM polls every step and never needs this; tests and the benchmark use it to see an
        outcome when it happens. While a request is in flight it polls as vLLM's step loop
        does (every ~20 us: a doorbell rings no thread, and the outcome a transfer thread
        records is seen without waking this one), else it sleeps until woken. True when an
        outcome is ready.
        """
        deadline = time.monotonic() + timeout_s
        with self._ended:
            while True:
                self._poll_bells()
                if any(r.result is not None for r in self._recvs.values()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self._recvs:
                    short_timer_slack()
                    self._ended.wait(min(left, _POLL_S))
                else:
                    self._ended.wait(left)

    # ------------------------------------------------------ producer events
    def on_write_done(self, note: WriteDone) -> None:
        """A producer rank ended its writes into us, or refused them (control thread)."""
        self._agent.trace.mark(note.transfer_id, "write_done_received")
        with self._agent.lock:
            recv = self._recvs.get(note.transfer_id)
            if recv is None or recv.result is not None or recv.producers is None:
                return
            if note.producer_rank < len(recv.producers):
                asked = recv.producers[note.producer_rank]
                if note.producer_key and note.producer_key != asked.key:  # a restarted process refused it
                    self._agent.forget(recv.addresses[note.producer_rank], asked.key)
                elif note.ok:
                    self._agent.confirm([asked])
            self._record_write_done(recv, note)

    def watched_producers(self) -> Dict[Address, str]:
        """Producers that owe a WRITE waiting for a probe interval or longer: address -> engine key (watch thread)."""
        now = time.monotonic()
        out: Dict[Address, str] = {}
        with self._agent.lock:
            for recv in self._recvs.values():
                if recv.requested and recv.result is None and now - recv.requested_at >= PROBE_INTERVAL_S:
                    for rank, (address, peer) in enumerate(zip(recv.addresses, recv.producers or [])):
                        if rank not in recv.write_dones:
                            out[address] = peer.key
        return out

    def on_producer_gone(self, address: Address, key: str, reason: str) -> None:
        """The producer process with engine ``key`` at ``address`` is gone (watch thread).

        Its WRITEs get no more bytes from it: each counts it as failed, tells the producer's
        other ranks to stop, and ends once all of them answered or are gone too.
        """
        self._agent.forget(address, key)
        with self._agent.lock:
            for recv in list(self._recvs.values()):
                if not recv.requested or recv.result is not None or recv.producers is None:
                    continue
                for rank, (where, peer) in enumerate(zip(recv.addresses, recv.producers)):
                    if where != address or peer.key != key or rank in recv.write_dones:
                        continue
                    logger.warning("MoriSuiteConnector: request %s: prefill rank %d is gone: %s",
                                   recv.job.req_id, rank, reason)
                    self._stop_writes(recv, f"prefill rank {rank} is gone: {reason}")
                    self._record_write_done(recv, WriteDone(
                        transfer_id=recv.job.transfer_id, producer_rank=rank, producer_tp=len(recv.producers),
                        ok=False, nbytes=0, elapsed_us=0, reason=f"prefill process gone: {reason}"[:4000],
                        producer_key=key))

    # ------------------------------------------------------------ internals
    def _poll_bells(self) -> None:
        """Count producer ranks whose doorbell rang as ended (lock held)."""
        board = self._agent.doorbells
        if board is None:
            return
        for recv in list(self._recvs.values()):
            if recv.result is not None or not recv.requested or recv.producers is None:
                continue
            for rank, bell in enumerate(recv.bells):
                if bell is None or rank in recv.write_dones:
                    continue
                rung = board.rung(*bell)
                if rung is None:
                    continue
                peer = recv.producers[rank]
                self._agent.trace.mark(recv.job.transfer_id, "doorbell_seen")
                self._agent.confirm([peer])
                self._record_write_done(recv, WriteDone(
                    transfer_id=recv.job.transfer_id, producer_rank=rank, producer_tp=len(recv.producers), ok=True,
                    nbytes=rung[0], elapsed_us=rung[1], producer_key=peer.key))
                if recv.result is not None:
                    break

    def _record_write_done(self, recv: _Recv, note: WriteDone) -> None:
        """Count one producer rank as ended; finish the request once every rank is (lock held)."""
        recv.write_dones[note.producer_rank] = note
        if len(recv.write_dones) >= note.producer_tp:
            failed = [d for d in recv.write_dones.values() if not d.ok]
            reason = failed[0].reason if failed else ""
            self._finish(recv, not failed, reason,
                         nbytes=sum(d.nbytes for d in recv.write_dones.values()),
                         transfer_ms=max(d.elapsed_us for d in recv.write_dones.values()) / 1000)

    def _stop_writes(self, recv: _Recv, reason: str) -> None:
        """WRITE: tell every producer rank to stop writing into this request (once; lock held)."""
        if not recv.abort_sent:
            recv.abort_sent = True
            self._notify_producers(recv, ok=False, nbytes_by_rank={}, reason=reason)

    def _producers(self, job: RecvJob) -> Tuple[List[Address], List["Peer"]]:
        """Handshake addresses and peers of every producer rank (index = rank)."""
        assert job.peer is not None
        agent, engine_id, instance = self._agent, job.remote_engine_id, job.remote_instance_id
        rank0 = agent.fetch_peer(job.peer, 0, job.peer.tp_size_hint, engine_id, instance)
        tp = rank0.meta.tp_size
        peers = [rank0] + [agent.fetch_peer(job.peer, r, tp, engine_id, instance) for r in range(1, tp)]
        return self._addresses(job, tp), peers

    def _addresses(self, job: RecvJob, tp: int) -> List[Address]:
        """Handshake addresses of the ``tp`` producer ranks of ``job`` (rank 0 by the params' tp hint)."""
        assert job.peer is not None
        agent = self._agent
        return [agent.peer_address(job.peer, 0, job.peer.tp_size_hint)] + [
            agent.peer_address(job.peer, r, tp) for r in range(1, tp)]

    def _cached_producers(self, job: RecvJob) -> Optional[Tuple[List[Address], List["Peer"]]]:
        """:meth:`_producers` when every rank's handshake is cached and trusted (no I/O), else None."""
        if job.peer is None:
            return None
        agent, engine_id, instance = self._agent, job.remote_engine_id, job.remote_instance_id
        rank0 = agent.cached_peer(job.peer, 0, job.peer.tp_size_hint, engine_id, instance)
        if rank0 is None:
            return None
        tp = rank0.meta.tp_size
        peers = [rank0]
        for r in range(1, tp):
            peer = agent.cached_peer(job.peer, r, tp, engine_id, instance)
            if peer is None:
                return None
            peers.append(peer)
        return self._addresses(job, tp), peers

    def _block_pairs(self, job: RecvJob) -> List[Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
        """READ: per group (local, remote) block arrays of the positions to move."""
        remote = job.remote_block_ids or []
        pairs = []
        for g, local in enumerate(job.local_block_ids):
            n = min(self._agent.group_positions(g, job.num_prompt_tokens), len(local))
            start = job.positions[g]
            if g >= len(remote):
                raise PlanError(f"the prefill sent blocks of {len(remote)} KV cache groups, the decode has {len(job.local_block_ids)}")
            src, dst = pair_blocks(remote[g][start:n], local[start:n], job.null_block_id)
            pairs.append((dst, src))
        return pairs

    def _run(self, recv: _Recv, known: Optional[Tuple[List[Address], List["Peer"]]] = None) -> None:
        """Handshake (unless ``known`` gives the producers), then READ or request the WRITEs."""
        job, agent = recv.job, self._agent
        try:
            addresses, producers = known if known is not None else self._producers(job)
            agent.trace.mark(job.transfer_id, "handshake_done")
            with agent.lock:
                recv.producers, recv.addresses = producers, addresses
                if recv.aborted:
                    self._notify_producers(recv, ok=False, nbytes_by_rank={}, reason="the decode request was aborted")
                    self._finish(recv, False, "aborted")
                    return
            if job.mode == "read":
                self._read(recv, producers, submit_only=known is not None)
            else:
                self._request_writes(recv, producers)
        except HandshakeError as e:  # fetch_peer dropped what it had cached there
            with agent.lock:
                self._finish(recv, False, f"handshake with the prefill failed: {e}")
        except PlanError as e:
            with agent.lock:
                if recv.producers is not None:
                    self._notify_producers(recv, ok=False, nbytes_by_rank={}, reason=str(e))
                self._finish(recv, False, f"KV layouts of prefill and decode cannot be paired: {e}")
        except Exception as e:  # never leave a request waiting forever
            logger.exception("MoriSuiteConnector: KV receive of %s failed", job.req_id)
            with agent.lock:
                self._finish(recv, False, f"KV receive error: {e!r}")

    def _read(self, recv: _Recv, producers: List["Peer"], submit_only: bool = False) -> None:
        """Pull the blocks from every producer rank: one batch each, then wait for them (unless ``submit_only``)."""
        agent, job = self._agent, recv.job
        ident = agent.identity
        blocks = self._block_pairs(job)
        statuses, nbytes_by_rank = [], {}
        t0 = time.monotonic()
        try:
            for peer in producers:
                pairs = cached_head_pairs(ident.total_kv_heads, peer.meta.tp_size, peer.meta.tp_rank, ident.tp_size,
                                          ident.tp_rank, ident.replicated_heads)
                nbytes_by_rank[peer.meta.tp_rank] = agent.submit_layers(peer, False, blocks, pairs, None,
                                                                        job.transfer_id, statuses)
        except BaseException:
            # Reads already submitted (an earlier producer, a lead part) still land in our blocks: they
            # end before the caller records the failure and vLLM may hand the blocks to another request.
            _, quiescent = await_statuses(agent.engine, statuses, agent.config.transfer_timeout_s)
            if not quiescent:
                await_statuses(agent.engine, statuses, agent.config.tcp_op_timeout_ms / 1000 + 5)
            raise
        if submit_only:  # the caller must not wait: a transfer thread waits (while the copy runs)
            agent.pool.submit(self._read_wait, recv, producers, statuses, nbytes_by_rank, t0)
        else:
            self._read_wait(recv, producers, statuses, nbytes_by_rank, t0)

    def _read_wait(self, recv: _Recv, producers: List["Peer"], statuses: List[Any], nbytes_by_rank: Dict[int, int],
                   t0: float) -> None:
        """Wait (bounded) for a READ's statuses, then tell the producers and record the outcome."""
        agent, job = self._agent, recv.job
        reason, quiescent = await_statuses(agent.engine, statuses, agent.config.transfer_timeout_s)
        agent.trace.mark(job.transfer_id, "statuses_done")
        if not quiescent:  # reads still land in our blocks: wait for the engine's own timeouts to end them
            await_statuses(agent.engine, statuses, agent.config.tcp_op_timeout_ms / 1000 + 5)
        ms = (time.monotonic() - t0) * 1000
        if reason is None:
            agent.confirm(producers)
        else:  # the peer may have died or restarted: handshake again next time
            for address, peer in zip(recv.addresses, producers):
                agent.forget(address, peer.key)
        ok = reason is None
        with agent.lock:
            self._finish(recv, ok, reason or "", nbytes=sum(nbytes_by_rank.values()), transfer_ms=ms)
        # After the outcome is visible: encoding and queueing these cost tens of us per producer.
        self._notify_producers(recv, ok=ok, nbytes_by_rank=nbytes_by_rank if ok else {}, reason=reason or "")

    def _request_writes(self, recv: _Recv, producers: List["Peer"]) -> None:
        agent, job = self._agent, recv.job
        block_ids, positions = [], []
        for g, local in enumerate(job.local_block_ids):
            n = min(agent.group_positions(g, job.num_prompt_tokens), len(local))
            start = min(job.positions[g], n)
            block_ids.append([int(b) for b in local[start:n]])
            positions.append(start)
        budget_ms = int(max(0.0, recv.deadline - time.monotonic() - agent.config.transfer_timeout_s) * 1000)
        request = WriteRequest(
            transfer_id=job.transfer_id, consumer=agent.metadata_raw, block_ids=block_ids, positions=positions,
            budget_ms=budget_ms,
        )
        board = agent.doorbells
        with agent.lock:
            if recv.result is not None:
                return
            recv.bells = [board.acquire() if board is not None else None for _ in producers]
            for peer, bell in zip(producers, recv.bells):  # each rank's request names the process we handshook with
                slot, seq = bell if bell is not None else (-1, 0)
                agent.notifier.send(peer.meta.notify_host, peer.meta.notify_port,
                                    msgspec.structs.replace(request, producer_key=peer.key, doorbell_slot=slot,
                                                            doorbell_seq=seq),
                                    inbox=peer.meta.inbox)
            recv.requested, recv.requested_at = True, time.monotonic()
        agent.trace.mark(job.transfer_id, "write_request_sent")
        if agent.control is not None:  # WriteDone messages will follow (a doorbell may beat them)
            agent.control.expect()

    def _release(self, job: RecvJob) -> None:
        """Nothing to move (full local prefix hit, or aborted before allocation): free the producer's blocks."""
        try:
            _, producers = self._producers(job)
        except HandshakeError as e:
            logger.info("MoriSuiteConnector: could not release %s on the prefill (%s)", job.transfer_id, e)
            return
        ident = self._agent.identity
        for peer in producers:
            self._agent.notifier.send(
                peer.meta.notify_host,
                peer.meta.notify_port,
                ConsumerDone(transfer_id=job.transfer_id, consumer_key=self._agent.engine_key,
                             consumer_rank=ident.tp_rank, consumer_tp=ident.tp_size, ok=True, nbytes=0,
                             reason="the decode needs no KV of this request", producer_key=peer.key),
            )

    def _notify_producers(self, recv: _Recv, ok: bool, nbytes_by_rank: Dict[int, int], reason: str) -> None:
        ident = self._agent.identity
        for peer in recv.producers or []:
            self._agent.notifier.send(
                peer.meta.notify_host,
                peer.meta.notify_port,
                ConsumerDone(transfer_id=recv.job.transfer_id, consumer_key=self._agent.engine_key,
                             consumer_rank=ident.tp_rank, consumer_tp=ident.tp_size, ok=ok,
                             nbytes=nbytes_by_rank.get(peer.meta.tp_rank, 0), reason=reason[:4000],
                             producer_key=peer.key),
            )

    def _finish(self, recv: _Recv, ok: bool, reason: str, nbytes: int = 0, transfer_ms: float = 0.0) -> None:
        """Record the outcome (lock held); the next :meth:`take_results` reports it."""
        if recv.result is not None:
            return
        board = self._agent.doorbells
        for bell in recv.bells:
            if bell is not None and board is not None:
                board.release(bell[0])
        ok = ok and not recv.aborted
        counters = self._agent.counters
        if ok:
            counters.add("bytes_received", nbytes)
            counters.add("transfers_ok", 1)
            counters.observe_ms(transfer_ms)
        else:
            counters.add("transfers_failed", 1)
            if not recv.aborted:
                logger.warning("MoriSuiteConnector: KV of request %s did not arrive: %s", recv.job.req_id, reason)
        recv.result = RecvResult(
            req_id=recv.job.req_id,
            ok=ok,
            aborted=recv.aborted,
            mode=recv.job.mode,
            nbytes=nbytes if ok else 0,
            transfer_ms=transfer_ms,
            wait_ms=(time.monotonic() - recv.started) * 1000,
            reason=reason,
        )
        self._agent.trace.mark(recv.job.transfer_id, "result")
        self._ended.notify_all()
