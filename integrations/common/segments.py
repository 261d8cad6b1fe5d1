"""Byte segments for ``IOEngine.batch_read`` / ``batch_write``: pure functions over numbers.

* Paged pools are item-major per region: item ``i`` of a region with ``item_len``
  bytes per item is bytes ``[i * item_len, (i + 1) * item_len)``. Runs of items
  contiguous on both sides become one segment (:func:`index_runs`).
* :func:`merge_adjacent` joins consecutive segments that touch on both sides.
* A :class:`TransferBatch` collects segments over many (local, remote) region
  pairs and submits them with one engine call, or two (:func:`lead_units`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from mori_core.io import IOEngine, MemoryDesc, StatusCode, TransferStatus

__all__ = [
    "LEAD_MIN_BYTES",
    "LEAD_MIN_UNITS",
    "PlanError",
    "await_statuses",
    "Segments",
    "TransferBatch",
    "as_indices",
    "contiguous_segments",
    "index_runs",
    "lead_units",
    "merge_adjacent",
]

Segments = Tuple[List[int], List[int], List[int]]  # local offsets, remote offsets, sizes

# A transfer is split into a lead call and the rest only when both pay: enough units for a
# quarter to be a real part, and enough bytes for the lead's copy (~1/4 of >= 32 MiB: >= 20 us
# over NVLink) to cover the host work of the rest's call.
LEAD_MIN_UNITS = 8
LEAD_MIN_BYTES = 32 << 20


def lead_units(units: int, nbytes: int) -> int:
    """How many of a transfer's ``units`` (layers, region pairs) to submit in a first engine call of their own.

    Where an engine call only queues the copy (XGMI: a kernel launch; RDMA: posted work), the
    copy of a lead part runs while the host still plans and submits the rest, instead of after
    all of it: for a 2,048-token KV request that host work is 0.1-0.2 ms against a ~0.7 ms copy.
    A quarter of the units when there are at least :data:`LEAD_MIN_UNITS` and ``nbytes`` is at
    least :data:`LEAD_MIN_BYTES`, else 0 (one call). Over TCP the split costs one more call and
    gains nothing, which is noise at these sizes.
    """
    if units < LEAD_MIN_UNITS or nbytes < LEAD_MIN_BYTES:
        return 0
    return units // 4


class PlanError(ValueError):
    """Two sides' layouts cannot be paired (a configuration error, not a transport one)."""


@dataclasses.dataclass
class TransferBatch:
    """Segments of one transfer step, one entry per (local region, remote region) pair."""

    local: List[MemoryDesc] = dataclasses.field(default_factory=list)
    local_offsets: List[List[int]] = dataclasses.field(default_factory=list)
    remote: List[MemoryDesc] = dataclasses.field(default_factory=list)
    remote_offsets: List[List[int]] = dataclasses.field(default_factory=list)
    sizes: List[List[int]] = dataclasses.field(default_factory=list)

    def add(self, local: MemoryDesc, remote: MemoryDesc, segments: Segments) -> None:
        """Queue ``segments`` (lists or int64 arrays) between ``local`` and ``remote`` (empty ones are dropped)."""
        lo, ro, sz = segments
        if len(sz) == 0:
            return
        self.local.append(local)
        self.local_offsets.append(lo)
        self.remote.append(remote)
        self.remote_offsets.append(ro)
        self.sizes.append(sz)

    @property
    def nbytes(self) -> int:
        """Bytes of every queued segment. Entries that share one sizes object (SGLang's layers
        reuse one plan per page size) are summed once: a ``np.sum`` costs ~2-5 us, which over
        66 region pairs was 0.15-0.4 ms of a chunk's time."""
        sums: Dict[int, int] = {}
        total = 0
        for sz in self.sizes:
            n = sums.get(id(sz))  # the batch holds every sizes object: ids stay unique meanwhile
            if n is None:
                n = sums[id(sz)] = int(np.sum(sz)) if isinstance(sz, np.ndarray) else sum(sz)
            total += n
        return total

    def __len__(self) -> int:
        return len(self.sizes)

    def submit(
        self, engine: IOEngine, *, read: bool = False, lead: int = 0, into: Optional[List[TransferStatus]] = None
    ) -> List[TransferStatus]:
        """``batch_write`` (or ``batch_read``) everything queued; one status per region pair, in order.

        ``lead`` in ``(0, len(self))``: the first ``lead`` region pairs go in a call of their own
        before the rest (see :func:`lead_units`). ``into``: a list the statuses are appended to as
        each call returns, so that when the second call raises, the caller still holds the first
        call's statuses (their copies are in flight and must be waited for); it is also returned.
        """
        out = into if into is not None else []
        n = len(self.sizes)
        if n == 0:
            return out
        call = engine.batch_read if read else engine.batch_write
        if not 0 < lead < n:
            uids = [engine.allocate_transfer_uid() for _ in range(n)]
            out.extend(call(self.local, self.local_offsets, self.remote, self.remote_offsets, self.sizes, uids))
            return out
        for lo, hi in ((0, lead), (lead, n)):
            uids = [engine.allocate_transfer_uid() for _ in range(hi - lo)]
            try:
                out.extend(call(self.local[lo:hi], self.local_offsets[lo:hi], self.remote[lo:hi],
                                self.remote_offsets[lo:hi], self.sizes[lo:hi], uids))
            except (TypeError, ValueError) as e:  # the engine names entries of its own call
                e.add_note(f"TransferBatch.submit: that call carried entries {lo}..{hi - 1} of the batch "
                           f"(entry i of the message is entry {lo} + i of the batch)")
                raise
        return out


def as_indices(values: Sequence[int] | npt.NDArray) -> npt.NDArray[np.int64]:
    """A flat int64 copy of page/slot/block indices (frameworks pass int32 arrays or lists)."""
    return np.asarray(values, dtype=np.int64).ravel()


def index_runs(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> Tuple[npt.NDArray, npt.NDArray, npt.NDArray]:
    """Split paired indices into runs that are +1 contiguous on both sides.

    Returns (src_starts, dst_starts, lengths).
    """
    if src.size != dst.size:
        raise PlanError(f"{src.size} source indices but {dst.size} destination indices")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return src[starts], dst[starts], ends - starts


def contiguous_segments(
    src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64], src_item_len: int, dst_item_len: int,
    *, as_lists: bool = True,
) -> Segments:
    """Whole items (pages or state slots) copied index to index (int64 arrays with ``as_lists=False``)."""
    if src_item_len != dst_item_len:
        raise PlanError(f"item sizes differ: source {src_item_len} B, destination {dst_item_len} B")
    s, d, n = index_runs(src, dst)
    out = (s * src_item_len, d * dst_item_len, n * src_item_len)
    return tuple(a.tolist() for a in out) if as_lists else out  # type: ignore[return-value]


def merge_adjacent(
    local: npt.NDArray[np.int64], remote: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64],
    *, as_lists: bool = True,
) -> Segments:
    """Join consecutive segments that continue each other on both sides (order is kept).

    Returns lists, or int64 arrays with ``as_lists=False`` (the engine reads arrays in one copy;
    when nothing joins, these are the given arrays themselves).
    """
    if sizes.size == 0:
        return ([], [], []) if as_lists else (local[:0], remote[:0], sizes[:0])
    ends_l = local + sizes
    joins = (ends_l[:-1] == local[1:]) & (remote[:-1] + sizes[:-1] == remote[1:])
    if not joins.any():  # scattered blocks: nothing to join (the common case of a KV request)
        if not as_lists:
            return local, remote, sizes
        return local.tolist(), remote.tolist(), sizes.tolist()
    breaks = np.flatnonzero(~joins) + 1
    starts = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [sizes.size - 1]))
    # A merged run is contiguous on the local side: its size is its end minus its start
    # (np.add.reduceat took 25 us for 4,096 segments; two gathers take a few).
    totals = ends_l[last] - local[starts]
    if not as_lists:
        return local[starts], remote[starts], totals
    return local[starts].tolist(), remote[starts].tolist(), totals.tolist()


def await_statuses(
    engine: IOEngine, statuses: List[TransferStatus], timeout_s: float, poll_ms: int = 200
) -> Tuple[Optional[str], bool]:
    """Wait (bounded) for a submission's statuses.

    Returns ``(failure reason or None, quiescent)``: ``quiescent`` is False only when the
    bound passed with transfers still in flight (their memory must then not be reused
    before the engine's own timeouts have ended them).
    """
    if not statuses:
        return None, True
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            return f"KV transfer did not finish within {timeout_s:g} s", False
        rc = engine.wait_all(statuses, timeout_ms=min(max(1, poll_ms), remaining_ms))
        if rc == StatusCode.SUCCESS:
            return None, True
        if rc != StatusCode.IN_PROGRESS:
            reason = next((f"KV transfer failed: {s.Message()}" for s in statuses if s.Failed()), f"KV transfer failed ({rc})")
            return reason, _drain(statuses, deadline)


def _drain(statuses: List[TransferStatus], deadline: float) -> bool:
    """Wait (bounded) for the transfers still in flight after a failure."""
    for s in statuses:
        while s.InProgress():
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return False
            s.WaitFor(min(remaining_ms, 1000))
    return True
