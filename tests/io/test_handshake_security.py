"""The handshake with a shared secret: what a relay or an unauthenticated peer can get.

Regression tests of issue #21 items 7 (handshake relay) and 8 (what leaks before
authentication), with real engines over loopback TCP.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import pytest

from io_peer import LocalBuffer, TargetProcess
from mori_core.bench.wire import (HELLO_MAGIC, raw_handshake, read_reply, recv_msg, request_header, send_msg,
                                  server_version)
from mori_core.io import BackendType, IOEngine, IOEngineConfig, StatusCode, TcpBackendConfig
from net_tools import HandshakeRelay, desc_at

SECRET = "relay-test-secret"


@pytest.fixture(scope="module")
def secret_target():
    t = TargetProcess("secret-target", secret=SECRET)
    yield t
    t.close()


def test_relayed_handshake_gives_the_relay_nothing(secret_target):
    """Item 7: an honest engine is handed a descriptor pointing at the attacker, who
    relays the handshake to the real target and then issues its own requests on the
    authenticated connection. The target must refuse them: nothing read, nothing written."""
    region, rm = secret_target.region(4096)
    view = np.frombuffer(region, dtype=np.uint8)
    view[:] = 0x11
    relay = HandshakeRelay(secret_target.desc.port)
    honest = IOEngine("honest", IOEngineConfig("127.0.0.1", 0, auth_secret=SECRET))
    honest.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=1))
    honest.register_remote_engine(desc_at(secret_target.desc, relay.port))
    local = LocalBuffer(honest, 4096)
    status = honest.write(local.desc, 0, rm, 0, 8, 1)  # makes the honest engine dial the relay
    assert relay.done.wait(10)
    up = relay.upstream
    assert up is not None and relay.accepted[:1] == b"\x01", "the relayed handshake itself completes"
    v = relay.version
    up.settimeout(5)
    stolen = b""
    try:
        # read the target's first 8 bytes, then write over them
        up.sendall(request_header(v, op=2, mem=rm.id, total=8, req=1) + struct.pack("<QQ", 0, 8))
        kind, code, req, _ = read_reply(up, v)
        if kind == 2:
            stolen = up.recv(8, socket.MSG_WAITALL)
        up.sendall(request_header(v, op=1, mem=rm.id, total=8, req=2) + struct.pack("<QQ", 0, 8) + b"PWNED!!!")
        read_reply(up, v)
    except (ConnectionError, socket.timeout, OSError, struct.error):
        pass  # the target dropped the relayed connection: what we want
    relay.close()
    status.WaitFor(10_000)
    assert stolen == b"", f"the relay read the target's bytes: {stolen!r}"
    assert bytes(region[:8]) == b"\x11" * 8, f"the relay wrote into the target: {bytes(region[:8])!r}"


def test_nothing_leaks_before_authentication(secret_target):
    """Item 8: a peer without the secret learns neither the engine key nor whether a
    secret is set from the server hello, and gets no server proof over a challenge."""
    key = secret_target.desc.key.encode()
    s = socket.create_connection(("127.0.0.1", secret_target.desc.port), timeout=5)
    challenge = b"\x00" * 32
    # Send our current hello; an older server answers it too (or drops us).
    send_msg(s, struct.pack("<IHB", HELLO_MAGIC, 2, 1) + challenge)
    try:
        hello = recv_msg(s)
    except ConnectionError:
        # a v1 server rejects the v2 hello: speak v1 to show what it reveals
        s = socket.create_connection(("127.0.0.1", secret_target.desc.port), timeout=5)
        send_msg(s, struct.pack("<IHBB", HELLO_MAGIC, 1, 1, 0) + struct.pack("<I", 4) + b"evil" + challenge)
        hello = recv_msg(s)
    assert key not in hello, "the server hello names the engine"
    version = server_version(hello)
    assert len(hello) == 4 + 2 + 32, f"server hello of {len(hello)} bytes: more than magic, version and a nonce"
    # a wrong proof: refused, and the refusal carries nothing either
    send_msg(s, struct.pack("<I", 4) + b"evil" + bytes(32))
    final = recv_msg(s)
    assert final == b"\x00", final
    assert key not in final
    s.close()
    assert version == 2


def test_unauthenticated_peer_is_refused_without_key(secret_target):
    """The helper client (no secret) is refused with a bare verdict."""
    s, final = raw_handshake(secret_target.desc.port, "no-secret")
    assert final == b"\x00"
    s.close()


def test_bad_handshakes_are_logged_once_per_interval(capfd):
    """Item 9 (IO engine): 300 garbage connections from one address give at most a few
    log lines, the later ones counting what was suppressed."""
    t = TargetProcess("log-target")
    try:
        capfd.readouterr()
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", t.desc.port), timeout=5)
            s.sendall(b"\xff" * 64)
            s.close()
        # wait until the listener has seen them all: a real transfer still works after
        e = IOEngine("log-initiator", IOEngineConfig("127.0.0.1", 0))
        e.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=1))
        e.register_remote_engine(t.desc)
        region, rm = t.region(4096)
        local = LocalBuffer(e, 4096)
        local.array[:] = 5
        assert e.write(local.desc, 0, rm, 0, 4096, 1).WaitFor(10_000) == StatusCode.SUCCESS
        assert bytes(region[:4]) == b"\x05" * 4
        time.sleep(0.5)
        err = capfd.readouterr().err
        lines = [ln for ln in err.splitlines() if "during handshake" in ln]
        assert 1 <= len(lines) <= 3, f"{len(lines)} handshake warnings for 300 bad connections"
    finally:
        t.close()
