"""The SGLang PD control socket's bounds (issue #29 items 2 and 4).

SGLang binds the manager's PULL socket itself; libzmq copies MAXMSGSIZE when a socket
binds, so the manager makes the bound a default of the context SGLang creates for it.
Real SGLang socket factory, real ZMQ sockets on loopback.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from mori_core.bench import zmtp
from mori_integrations.common.log_limit import RateLimitedLog
from mori_integrations.sglang import manager as mgr
from mori_integrations.sglang.messages import MAX_FRAME_BYTES, ControlMessageError
from sglang.srt.utils.network import get_zmq_socket_on_host


def _bare_manager() -> mgr.MoriKVManager:
    """A manager with only what its control loop uses (no engine, no SGLang scheduler)."""
    m = mgr.MoriKVManager.__new__(mgr.MoriKVManager)
    m._zmq_ctx = zmq.Context()  # what CommonKVManager.__init__ does, right before it binds
    m._stop = threading.Event()
    m._bad_input = RateLimitedLog(mgr.logger, what="bad control messages")
    return m


def test_frames_above_the_bound_are_cut_on_the_socket_sglang_binds() -> None:
    m = _bare_manager()
    port, server = get_zmq_socket_on_host(m._zmq_ctx, zmq.PULL, host="127.0.0.1")
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        assert server.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES <= 64 << 10
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"x" * (MAX_FRAME_BYTES + 1))
        assert not server.poll(1000), "a frame above the bound was delivered"
        push.close(0)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart([b"a", b"y" * MAX_FRAME_BYTES])  # at the bound: delivered
        assert server.poll(5000) and [len(f) for f in server.recv_multipart()] == [1, MAX_FRAME_BYTES]
    finally:
        push.close(0)
        server.close(0)
        m._zmq_ctx.term()


def test_bad_input_from_many_sources_is_logged_a_few_times(caplog) -> None:
    """1,000 bad messages from 250 source addresses: at most 5 lines, no traceback."""
    m = _bare_manager()
    port, m.server_socket = get_zmq_socket_on_host(m._zmq_ctx, zmq.PULL, host="127.0.0.1")
    handled = []

    def handle(frames: list) -> None:
        handled.append(len(frames))
        raise ControlMessageError("not a mori-suite control message")

    loop = threading.Thread(target=m._control_loop(handle), daemon=True)
    loop.start()
    caplog.set_level(logging.WARNING, logger=mgr.logger.name)
    socks = []
    try:
        for i in range(250):
            s = zmtp.connect(port, "PUSH", source=f"127.1.0.{i + 1}")
            s.sendall(zmtp.message([b"junk", b"\xff" * 8]) * 4)
            socks.append(s)
        deadline = time.monotonic() + 30
        while len(handled) < 1000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(handled) == 1000
        lines = [r for r in caplog.records if r.name == mgr.logger.name]
        assert 1 <= len(lines) <= 5 and not any(r.exc_info for r in lines), [r.getMessage() for r in lines]
        assert m._bad_input.events == 1000
    finally:
        m._stop.set()
        loop.join(5)
        for s in socks:
            s.close()
        m.server_socket.close(0)
        m._zmq_ctx.term()


@pytest.mark.parametrize("size", [0, 1, 40_000, 200_000])
def test_large_messages_travel_in_bounded_frames(size: int) -> None:
    from mori_integrations.sglang import messages as msgs

    meta = msgs.TransferMetadata(room=1, endpoint="10.0.0.1", rank_port=5555, engine_key="k",
                                 kv_pages=bytes(4 * (size // 4)), aux_index=-1, state_indices=[],
                                 required_dst_info_num=1, decode_prefix_len=0, is_dummy=False)
    frames = msgs.encode_message(meta)
    assert all(len(f) <= MAX_FRAME_BYTES for f in frames)
    assert msgs.decode_message(frames).kv_pages == meta.kv_pages
