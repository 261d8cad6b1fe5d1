"""The same-host inbox's framing and sender (integrations/common/local_inbox.py)."""

from __future__ import annotations

import time

import pytest

from mori_integrations.common.local_inbox import (
    MAX_DATAGRAM,
    MAX_FRAMES,
    LocalSender,
    inbox_name,
    pack_frames,
    try_inbox,
    unpack_frames,
)


def test_frames_round_trip_and_bad_datagrams_name_what_is_wrong() -> None:
    frames = [b"guard", b"", b"x" * 1000]
    assert unpack_frames(pack_frames(frames)) == frames
    data = pack_frames(frames)
    for bad, why in ((b"", "bad magic"), (b"XXXX" + data[4:], "bad magic"), (data[:-1], "add up to"),
                     (data + b"z", "add up to"), (data[:8], "truncated"), (b"MKI1\x00\x00", "0 frames")):
        with pytest.raises(ValueError, match=why):
            unpack_frames(bad)
    with pytest.raises(ValueError, match=f"at most {MAX_FRAMES}"):
        pack_frames([b""] * (MAX_FRAMES + 1))


def test_sender_queues_to_an_inbox_and_says_when_it_cannot() -> None:
    name = inbox_name(f"engine-{time.monotonic_ns()}")
    inbox = try_inbox(name)
    assert inbox is not None
    sender = LocalSender()
    try:
        assert try_inbox(name) is None  # one owner per name
        assert sender.send(name, [b"a", b"bc"])
        deadline = time.monotonic() + 5
        got = []
        while not got and time.monotonic() < deadline:
            got = inbox.receive()
        assert [unpack_frames(d) for d in got] == [[b"a", b"bc"]]
        assert not sender.send(name, [b"x" * MAX_DATAGRAM])  # too large for a datagram: another wire
        assert not sender.send(inbox_name("nobody"), [b"a"])  # no such inbox on this host
        assert not sender.send(name, [b""] * (MAX_FRAMES + 1))
    finally:
        sender.close()
        inbox.close()
    assert not sender.send(name, [b"a"])  # closed
