"""A transfer batch submitted in two engine calls (lead region pairs first), over a real IO engine.

The engine is the real core over TCP, in this process (``initiator``, conftest.py), writing into a
target engine in another process; a thin recorder in front of it notes which entries each call
carried and forwards the call unchanged.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np
import pytest

from io_peer import LocalBuffer, TargetProcess

from mori_core.io import IOEngine, StatusCode
from mori_integrations.common.segments import LEAD_MIN_BYTES, LEAD_MIN_UNITS, TransferBatch, lead_units

POISON = 0x5A
PAIRS = 10
PIECE = 4096


class _Recorder:
    """Forwards to the real engine; records the number of region pairs of each batch_write call."""

    def __init__(self, engine: IOEngine) -> None:
        self.engine, self.calls = engine, []  # type: ignore[var-annotated]

    def allocate_transfer_uid(self) -> int:
        return self.engine.allocate_transfer_uid()

    def batch_write(self, local: List[Any], lo: List[Any], remote: List[Any], ro: List[Any], sizes: List[Any],
                    uids: List[int]) -> List[Any]:
        self.calls.append(len(local))
        return self.engine.batch_write(local, lo, remote, ro, sizes, uids)


def test_lead_units_rule() -> None:
    assert lead_units(LEAD_MIN_UNITS - 1, 1 << 40) == 0, "too few units to split"
    assert lead_units(LEAD_MIN_UNITS, LEAD_MIN_BYTES - 1) == 0, "too few bytes for the overlap to pay"
    assert lead_units(LEAD_MIN_UNITS, LEAD_MIN_BYTES) == LEAD_MIN_UNITS // 4
    assert lead_units(32, 256 << 20) == 8
    assert lead_units(66, 256 << 20) == 16


def _batch(initiator: IOEngine, target: TargetProcess, rng: np.random.Generator, bad_pair: int = -1):
    """PAIRS region pairs, each: a local buffer -> its own remote region, two pieces."""
    batch, expect = TransferBatch(), []
    for i in range(PAIRS):
        local = LocalBuffer(initiator, 2 * PIECE)
        local.array[:] = rng.integers(0, 256, local.array.size, dtype=np.uint8)
        view, rdesc = target.region(4 * PIECE)
        remote = np.frombuffer(view, dtype=np.uint8)
        remote[:] = POISON
        ro = [3 * PIECE, PIECE]
        sizes = [PIECE, PIECE] if i != bad_pair else [PIECE, -1]  # bad: refused before anything is submitted
        batch.add(local.desc, rdesc, ([0, PIECE], ro, sizes))
        expect.append((local, remote, ro))
    return batch, expect


@pytest.mark.parametrize("lead", [0, 3])
def test_lead_pairs_go_in_a_first_call(initiator: IOEngine, target: TargetProcess, lead: int) -> None:
    rng = np.random.default_rng(7 + lead)
    batch, expect = _batch(initiator, target, rng)
    rec = _Recorder(initiator)
    statuses = batch.submit(rec, lead=lead)  # type: ignore[arg-type]
    assert rec.calls == ([lead, PAIRS - lead] if lead else [PAIRS])
    assert len(statuses) == PAIRS
    for st in statuses:
        assert st.WaitFor(20_000) == StatusCode.SUCCESS, st.Message()
    for local, remote, ro in expect:  # statuses are in entry order: every pair's bytes where they belong
        np.testing.assert_array_equal(remote[ro[0]:ro[0] + PIECE], local.array[:PIECE])
        np.testing.assert_array_equal(remote[ro[1]:ro[1] + PIECE], local.array[PIECE:])
    for local, _, _ in expect:
        initiator.deregister_memory(local.desc)


def test_a_failed_second_call_leaves_the_lead_statuses_with_the_caller(initiator: IOEngine,
                                                                          target: TargetProcess) -> None:
    """The rest's call is refused (a negative size): the error reaches the caller,
    and ``into`` holds the lead's statuses, whose writes still complete (the caller must wait for them)."""
    rng = np.random.default_rng(3)
    batch, expect = _batch(initiator, target, rng, bad_pair=PAIRS - 1)
    into: List[Any] = []
    with pytest.raises(TypeError, match=r"sizes\[5\]\[1\]") as err:
        batch.submit(initiator, lead=4, into=into)
    assert "entry 4 + i of the batch" in "\n".join(getattr(err.value, "__notes__", [])), "the index is not explained"
    assert len(into) == 4
    for st in into:
        assert st.WaitFor(20_000) == StatusCode.SUCCESS, st.Message()
    for local, remote, ro in expect[:4]:
        np.testing.assert_array_equal(remote[ro[0]:ro[0] + PIECE], local.array[:PIECE])
    for _, remote, _ in expect[4:]:
        assert (remote == POISON).all(), "a pair of the refused call was written"
    for local, _, _ in expect:
        initiator.deregister_memory(local.desc)
    err = None  # noqa: F841  (its traceback holds this frame, whose views pin the target's shared memory)


def test_nbytes_counts_every_entry_of_a_shared_plan() -> None:
    """SGLang's layers share one sizes array per page size: each entry still counts its bytes."""
    batch = TransferBatch()
    shared = np.full(128, 32 << 10, dtype=np.int64)
    zeros = np.zeros(128, dtype=np.int64)
    for _ in range(64):
        batch.add(None, None, (zeros, zeros, shared))  # type: ignore[arg-type]
    batch.add(None, None, ([0, 8], [0, 8], [5, 3]))  # type: ignore[arg-type]  (a list entry: the metadata row)
    batch.add(None, None, (zeros[:1], zeros[:1], np.array([7], dtype=np.int64)))  # type: ignore[arg-type]
    assert batch.nbytes == 64 * 128 * (32 << 10) + 8 + 7
