"""What the scheduler-side connector tells the worker-side connector each step (no vLLM import).

Plain dataclasses: vLLM pickles the step's connector metadata to every worker.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

__all__ = ["FinishedSend", "PeerAddress", "RecvJob", "SendJob", "StepPlan"]


@dataclasses.dataclass(frozen=True)
class PeerAddress:
    """Where the producer server's control plane listens (rank 0 of its DP rank)."""

    host: str
    handshake_port: int  # base port (+ dp_rank * tp_size + tp_rank per worker)
    notify_port: int
    dp_rank: int = 0
    tp_size_hint: int = 1  # needed only to find rank 0's port when dp_rank > 0


@dataclasses.dataclass(frozen=True)
class RecvJob:
    """Consumer: bring one request's prompt KV into these local blocks.

    ``mode`` is ``"write"`` (the producer pushes), ``"read"`` (we pull), ``"release"``
    (nothing to move: tell the producer it may free its blocks) or ``"invalid"`` (the
    request's kv_transfer_params cannot drive a transfer: report it failed). Block lists are per KV
    cache group and index-aligned with the producer's (position ``i`` = tokens
    ``[i * block_size, (i + 1) * block_size)``); positions before ``positions[g]`` are
    our own prefix-cache hits and are not moved.
    """

    req_id: str
    transfer_id: str
    mode: str
    peer: Optional[PeerAddress]
    local_block_ids: List[List[int]]
    positions: List[int]
    num_prompt_tokens: int
    remote_block_ids: Optional[List[List[int]]] = None  # READ: the producer's block lists
    remote_engine_id: Optional[str] = None  # vLLM engine id of the producer that holds the KV, when known
    # The producer *process* that holds the KV (its scheduler's per-start nonce, ``remote_instance_id``):
    # a server restarted on the same ports, even with a fixed engine id, is another instance.
    remote_instance_id: Optional[str] = None
    null_block_id: int = 0
    error: str = ""  # mode "invalid": why no transfer can be made (the request is reported failed)


@dataclasses.dataclass(frozen=True)
class SendJob:
    """Producer: this step computes the last prompt tokens of a request whose KV a consumer takes."""

    req_id: str
    transfer_id: str
    block_ids: List[List[int]]
    num_prompt_tokens: int
    null_block_id: int = 0


@dataclasses.dataclass(frozen=True)
class FinishedSend:
    """Producer: the request finished; its blocks stay until every consumer rank is done with them."""

    req_id: str
    transfer_id: str
    aborted: bool
    blocks_held: bool = True  # False: the scheduler already freed them (aborted before any write)


@dataclasses.dataclass
class StepPlan:
    """One step's jobs for the workers.

    ``instance_id``: the scheduler's per-process nonce, sent with every step so the workers
    (other processes under a multiprocess executor) can name the server instance whose KV
    they hold in their handshake metadata; a request's ``remote_instance_id`` must match it.
    """

    recv: List[RecvJob] = dataclasses.field(default_factory=list)
    send: List[SendJob] = dataclasses.field(default_factory=list)
    finished_sends: List[FinishedSend] = dataclasses.field(default_factory=list)
    instance_id: str = ""

    def __bool__(self) -> bool:
        return bool(self.recv or self.send or self.finished_sends)
