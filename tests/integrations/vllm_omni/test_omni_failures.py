"""Slow, stalled and dead peers: every wait is bounded and no buffer is freed under a transfer.

A stalled peer is a stage process stopped with SIGSTOP: its IO engine stops
reading its sockets, so a 64 MB write towards it stays in flight for as long
as the test wants (the kernel buffers hold far less than 64 MB with one TCP
connection). Pulls "on behalf of" a stopped receiver are sent from the test
with the receiver's real descriptors over the real control protocol.
"""

from __future__ import annotations

import time

import zmq

from omni_workers import wait_until
from mori_integrations.vllm_omni import protocol

BIG = 64 << 20
MB16 = 1_611_712  # seed 004's thinker -> talker size (rounded to float32)


def sender_extra(port: int, **kw: object) -> dict:
    extra = {"host": "127.0.0.1", "zmq_port": port, "role": "sender", "memory_pool_size": "8M"}
    extra.update(kw)
    return extra


def receiver_extra(port: int, **kw: object) -> dict:
    extra = {"host": "127.0.0.1", "role": "receiver", "sender_host": "127.0.0.1", "sender_zmq_port": port,
             "memory_pool_size": "8M"}
    extra.update(kw)
    return extra


class PullOnBehalf:
    """Sends a real PullRequest for a receiver that cannot (it is stopped)."""

    def __init__(self, port: int, secret: str = "") -> None:
        from mori_integrations.common.zmq_setup import secure_client

        self.codec = protocol.make_codec(secret)
        self.address = f"tcp://127.0.0.1:{port}"
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, self.codec.secret, self.codec.max_frame_bytes)
        self.sock.connect(self.address)
        self.binding = b""

    def send(self, key: str, desc: dict, length: int) -> None:
        frames = self.codec.encode(protocol.PullRequest(
            seq=1, key=key, engine_desc=desc["engine_desc"], mem_desc=desc["mem_desc"],
            dst_offset=desc["offset"], length=length), recipient=self.address)
        self.binding = self.codec.reply_binding(frames)
        self.sock.send_multipart(frames)

    def answer(self, timeout_s: float):
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.codec.decode(self.sock.recv_multipart(), recipient=self.binding)

    def close(self) -> None:
        self.sock.close(linger=0)


def test_ttl_and_cleanup_never_free_a_buffer_under_a_slow_transfer(omni_procs, free_base_port) -> None:
    snd, rcv = omni_procs[0], omni_procs[1]
    port = free_base_port(1)
    # The frozen receiver stands for a slow link here: no stopped-peer detection.
    snd.call("create", cid="ttl_s", extra=sender_extra(port, buffer_ttl_seconds=0.5, tcp_num_connections=1,
                                                       memory_pool_size="160M", tcp_heartbeat_timeout_ms=0))
    rcv.call("create", cid="ttl_r", extra=receiver_extra(port, tcp_num_connections=1, memory_pool_size="80M"))
    put = snd.call("put", cid="ttl_s", frm="0", to="1", key="slow", kind="bytes", nbytes=BIG, seed=11)
    desc = rcv.call("reserve", cid="ttl_r", size=BIG)
    puller = PullOnBehalf(port)
    rcv.freeze()
    try:
        puller.send("slow@0_1", desc, BIG)
        assert wait_until(lambda: snd.call("health", cid="ttl_s")["outbox_in_flight"] == 1, 10)
        time.sleep(1.5)  # three TTLs, three janitor sweeps, while the write is stuck
        health = snd.call("health", cid="ttl_s")
        assert health["ttl_skipped_in_flight"] >= 1
        assert health["outbox_entries"] == 1 and health["pool_used_bytes"] >= BIG
        # Explicit cleanup while in flight: the key goes, the bytes stay until the write ends.
        assert snd.call("cleanup", cid="ttl_s", key="slow", frm="0", to="1") is True
        # A new payload of the same size must not land on the bytes being sent:
        # if it did, the receiver would get a mix of both payloads below.
        other = snd.call("put", cid="ttl_s", frm="0", to="1", key="other", kind="bytes", nbytes=BIG, seed=12)
        assert other["ok"]
        assert snd.call("health", cid="ttl_s")["pool_used_bytes"] >= 2 * BIG
        assert puller.answer(0.0) is None  # still in flight
    finally:
        rcv.thaw()
    reply = puller.answer(30.0)
    puller.close()
    assert isinstance(reply, protocol.PullResponse) and reply.ok, reply
    assert rcv.call("reserved_digest", cid="ttl_r") == put["digest"]
    # The retired buffer is freed once the write ended; "other" (never pulled) expires by TTL.
    assert wait_until(lambda: snd.call("health", cid="ttl_s")["pool_used_bytes"] == 0, 10)
    assert snd.call("health", cid="ttl_s")["ttl_reclaimed"] >= 1
    snd.call("close", cid="ttl_s")
    rcv.call("close", cid="ttl_r")


def test_deadline_expiry_parks_the_pull_and_the_next_call_resumes_it(omni_procs, free_base_port) -> None:
    snd, rcv = omni_procs[0], omni_procs[1]
    port = free_base_port(1)
    snd.call("create", cid="dl_s", extra=sender_extra(port))
    rcv.call("create", cid="dl_r", extra=receiver_extra(port))
    put = snd.call("put", cid="dl_s", frm="0", to="1", key="k", kind="tensor", nbytes=MB16, seed=21)
    # Not there yet: None by the deadline, not later.
    miss = rcv.call("get", cid="dl_r", frm="0", to="1", key="nope", md=None, deadline_s=0.3)
    assert not miss["found"] and miss["elapsed_s"] < 2.0
    snd.freeze()
    try:
        first = rcv.call("get", cid="dl_r", frm="0", to="1", key="k", md=put["md"], deadline_s=0.5)
        assert not first["found"] and 0.4 <= first["elapsed_s"] < 3.0
        health = rcv.call("health", cid="dl_r")
        assert health["parked_pulls"] == 1 and health["pool_used_bytes"] >= MB16
        again = rcv.call("get", cid="dl_r", frm="0", to="1", key="k", md=put["md"], deadline_s=0.2)
        assert not again["found"] and again["elapsed_s"] < 2.0
    finally:
        snd.thaw()
    got = rcv.call("get", cid="dl_r", frm="0", to="1", key="k", md=put["md"], deadline_s=20)
    assert got["found"] and got["digest"] == put["digest"]
    health = rcv.call("health", cid="dl_r")
    assert health["parked_pulls"] == 0 and health["pool_used_bytes"] == 0
    snd.call("close", cid="dl_s")
    rcv.call("close", cid="dl_r")


def test_abandoned_get_keeps_its_buffer_until_the_sender_answers(omni_procs, free_base_port) -> None:
    snd, rcv = omni_procs[0], omni_procs[1]
    port = free_base_port(1)
    snd.call("create", cid="ab_s", extra=sender_extra(port))
    rcv.call("create", cid="ab_r", extra=receiver_extra(port))
    put = snd.call("put", cid="ab_s", frm="0", to="1", key="k2", kind="object", nbytes=3305, seed=31)
    snd.freeze()
    try:
        miss = rcv.call("get", cid="ab_r", frm="0", to="1", key="k2", md=put["md"], deadline_s=0.3)
        assert not miss["found"]
        rcv.call("abandon_get", cid="ab_r", key="k2")
        time.sleep(1.0)  # janitor sweeps: the buffer must stay reserved, the sender is still to write
        health = rcv.call("health", cid="ab_r")
        assert health["abandoned_pending"] == 1 and health["pool_used_bytes"] >= put["size"]
    finally:
        snd.thaw()
    assert wait_until(lambda: rcv.call("health", cid="ab_r")["pool_used_bytes"] == 0, 10)
    health = rcv.call("health", cid="ab_r")
    assert health["abandoned_released"] == 1 and health["parked_pulls"] == 0
    # The sender served the pull (it cannot know the caller left): the payload is consumed.
    assert snd.call("health", cid="ab_s")["outbox_entries"] == 0
    assert not rcv.call("get", cid="ab_r", frm="0", to="1", key="k2", md=put["md"], deadline_s=1)["found"]
    snd.call("close", cid="ab_s")
    rcv.call("close", cid="ab_r")


def test_dead_sender_fails_every_kind_of_get_within_bounds(omni_procs, stage_procs, free_base_port) -> None:
    rcv = omni_procs[1]
    port = free_base_port(1)
    doomed = stage_procs("omni-dead-sender")
    doomed.call("create", cid="ds", extra=sender_extra(port))
    rcv.call("create", cid="dr", extra=receiver_extra(port, transfer_timeout_s=2, query_timeout_s=1))
    put = doomed.call("put", cid="ds", frm="0", to="1", key="k", kind="tensor", nbytes=MB16, seed=41)
    doomed.kill()
    full = rcv.call("get", cid="dr", frm="0", to="1", key="k", md=put["md"], timeout=30)
    assert not full["found"] and full["elapsed_s"] < 5.0
    partial = rcv.call("get", cid="dr", frm="0", to="1", key="k",
                       md={"source_host": "127.0.0.1", "source_port": port}, timeout=30)
    assert not partial["found"] and partial["elapsed_s"] < 3.0
    configured = rcv.call("get", cid="dr", frm="0", to="1", key="k", md=None, timeout=30)
    assert not configured["found"] and configured["elapsed_s"] < 3.0
    # The pull that never got an answer holds its destination only for a bounded time.
    assert rcv.call("health", cid="dr")["parked_pulls"] == 1
    assert wait_until(lambda: rcv.call("health", cid="dr")["pool_used_bytes"] == 0, 15)
    assert rcv.call("health", cid="dr")["parked_expired"] == 1
    rcv.call("close", cid="dr")


def test_dead_receiver_mid_transfer_fails_the_write_and_keeps_the_payload(
        omni_procs, stage_procs, free_base_port) -> None:
    snd, other = omni_procs[0], omni_procs[2]
    port = free_base_port(1)
    snd.call("create", cid="dw_s", extra=sender_extra(port, tcp_num_connections=1, tcp_op_timeout_ms=2000,
                                                      memory_pool_size="80M"))
    doomed = stage_procs("omni-dead-receiver")
    doomed.call("create", cid="er", extra=receiver_extra(port, tcp_num_connections=1, memory_pool_size="80M"))
    put = snd.call("put", cid="dw_s", frm="0", to="1", key="big", kind="bytes", nbytes=BIG, seed=51)
    desc = doomed.call("reserve", cid="er", size=BIG)
    puller = PullOnBehalf(port)
    doomed.freeze()
    puller.send("big@0_1", desc, BIG)
    assert wait_until(lambda: snd.call("health", cid="dw_s")["outbox_in_flight"] == 1, 10)
    doomed.kill()
    t0 = time.monotonic()
    reply = puller.answer(30.0)
    puller.close()
    assert isinstance(reply, protocol.PullResponse) and not reply.ok and not reply.write_pending, reply
    assert time.monotonic() - t0 < 15.0
    health = snd.call("health", cid="dw_s")
    assert health["write_errors"] >= 1 and health["outbox_entries"] == 1 and health["outbox_in_flight"] == 0
    # Kept for a retry: another receiver gets it intact.
    other.call("create", cid="retry", extra=receiver_extra(port, memory_pool_size="80M"))
    got = other.call("get", cid="retry", frm="0", to="1", key="big", md=put["md"])
    assert got["found"] and got["digest"] == put["digest"]
    snd.call("close", cid="dw_s")
    other.call("close", cid="retry")


def test_missing_core_is_a_clear_error_at_construction() -> None:
    missing = "mori_core._C"
    import subprocess
    import sys

    code = (
        "import sys\n"
        f"sys.modules[{missing!r}] = None\n"  # makes `import` of it fail, like a broken install
        "from mori_integrations.vllm_omni import plugin\n"
        "plugin.register()\n"
        "from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory\n"
        "from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec\n"
        "try:\n"
        "    OmniConnectorFactory.create_connector(ConnectorSpec('MoriTransferEngineConnector', {'role': 'receiver'}))\n"
        "except ValueError as e:\n"
        "    print('ERROR:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ERROR:")), out.stdout + out.stderr)
    assert "needs the compiled core `mori_core._C`" in line, line
    assert "Install mori-suite" in line
