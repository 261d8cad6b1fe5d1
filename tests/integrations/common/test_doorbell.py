"""Same-host doorbells (integrations/common/doorbell.py): a board, rings from another process,
what a sender refuses to open, and the removal of a dead owner's board."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct

import pytest

from mori_integrations.common.doorbell import SHM_DIR, DoorbellBoard, DoorbellError, DoorbellRing

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="this host has no /dev/shm")


def _ring_from_child(name: str, key: str, slot: int, seq: int) -> None:
    DoorbellRing(name, key).ring(slot, seq, 1234, 56)


def test_ring_from_another_process_is_seen_once_and_only_with_its_sequence_number() -> None:
    board = DoorbellBoard("engine-a", slots=4)
    try:
        slot, seq = board.acquire()
        assert board.rung(slot, seq) is None
        child = mp.get_context("spawn").Process(target=_ring_from_child, args=(board.name, "engine-a", slot, seq))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert board.rung(slot, seq) == (1234, 56)
        assert board.rung(slot, seq + 1) is None  # another transfer's number: not this one's ring
        board.release(slot)
        # Slots are reused last (FIFO) and every acquisition gets a new sequence number, cleared.
        taken = [board.acquire() for _ in range(4)]
        assert [s for s, _ in taken] == [1, 2, 3, slot]
        assert len({q for _, q in taken} | {seq}) == 5
        assert board.rung(slot, taken[-1][1]) is None
        assert board.acquire() is None  # every slot taken: the caller uses control messages
    finally:
        board.close()
    assert not os.path.exists(os.path.join(SHM_DIR, board.name))


def test_sender_refuses_what_is_not_the_receivers_board(tmp_path) -> None:
    board = DoorbellBoard("engine-a", slots=2)
    try:
        with pytest.raises(DoorbellError, match="another engine"):
            DoorbellRing(board.name, "engine-b")
        for bad in ("../etc/passwd", "mori-bell-1-abc", "mori-bell-1-0123456789abcdef/../x", "", "x" * 80):
            with pytest.raises(DoorbellError, match="not of the form"):
                DoorbellRing(bad, "engine-a")
        missing = "mori-bell-1-0123456789abcdef"
        with pytest.raises(DoorbellError, match="another host"):
            DoorbellRing(missing, "engine-a")
        # A file of the right name that is not a board (wrong magic, or truncated).
        fake = os.path.join(SHM_DIR, "mori-bell-2-0123456789abcdef")
        try:
            with open(fake, "wb") as f:
                f.write(b"NOTABELL" + bytes(200))
            with pytest.raises(DoorbellError, match="not a doorbell board"):
                DoorbellRing(os.path.basename(fake), "engine-a")
            with open(fake, "wb") as f:
                f.write(b"x")
            with pytest.raises(DoorbellError, match="smaller than a board header"):
                DoorbellRing(os.path.basename(fake), "engine-a")
        finally:
            os.unlink(fake)
        # A symlink to a board is not followed.
        link = os.path.join(SHM_DIR, "mori-bell-3-0123456789abcdef")
        os.symlink(os.path.join(SHM_DIR, board.name), link)
        try:
            with pytest.raises(DoorbellError, match="cannot open"):
                DoorbellRing(os.path.basename(link), "engine-a")
        finally:
            os.unlink(link)
        ring = DoorbellRing(board.name, "engine-a")
        with pytest.raises(ValueError, match="slot 2 is outside"):
            ring.ring(2, 1, 0, 0)
        with pytest.raises(ValueError, match="sequence number 0"):
            ring.ring(0, 0, 0, 0)
        ring.close()
    finally:
        board.close()


def _own_board_then_wait(conn) -> None:
    board = DoorbellBoard("engine-dead")
    conn.send(board.name)
    signal.pause()


def test_a_killed_owners_board_is_removed_by_the_next_board_and_a_live_one_is_not() -> None:
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_own_board_then_wait, args=(child_end,))
    child.start()
    try:
        dead = parent.recv()
        live = DoorbellBoard("engine-live")
        try:
            assert os.path.exists(os.path.join(SHM_DIR, dead))
            DoorbellBoard("engine-probe").close()  # the owner still runs: its board stays
            assert os.path.exists(os.path.join(SHM_DIR, dead))
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
            DoorbellBoard("engine-probe").close()
            assert not os.path.exists(os.path.join(SHM_DIR, dead))
            assert os.path.exists(os.path.join(SHM_DIR, live.name))
        finally:
            live.close()
    finally:
        if child.is_alive():
            child.kill()
        child.join(30)


def test_board_header_layout_is_what_senders_check() -> None:
    board = DoorbellBoard("engine-a", slots=3)
    try:
        with open(os.path.join(SHM_DIR, board.name), "rb") as f:
            data = f.read()
        magic, slots, slot_bytes = struct.unpack_from("<8sII", data, 0)
        assert (magic, slots, slot_bytes) == (b"MORIBEL1", 3, 32)
        assert len(data) == 64 + 3 * 32
        assert oct(os.stat(os.path.join(SHM_DIR, board.name)).st_mode & 0o777) == "0o600"
    finally:
        board.close()
    with pytest.raises(ValueError, match="slots=0 is outside"):
        DoorbellBoard("engine-a", slots=0)
