"""The RDMA control-plane messages: round trips and rejection of malformed,
truncated or oversized input (a hostile peer must not crash the engine)."""

from __future__ import annotations

import random
import struct
from types import ModuleType

import pytest

GID = "0000:0000:0000:0000:0000:ffff:0a00:0001"
PORT = {"nic": "mlx5_0:1", "port": 1, "link_layer": 2, "active_mtu": 5, "max_rd_atomic": 16, "lid": 0, "use_grh": 1,
        "gid": GID, "max_msg_size": 1 << 31}

SAMPLES = {
    "hello": {},
    "hello_reply": {"link_layer_mask": 4, "num_nics": 8},
    "get_memory": {"mem_id": 4242},
    "memory_info": {"code": 0, "message": "", "nic": "mlx5_3:1", "addr": 0x7F0000001000, "size": 1 << 30,
                    "rkey": 0xDEADBEEF},
    "connect": {"group_id": 77, "target_nic": "mlx5_1:1", "initiator": PORT, "qps": [(0x123, 0xABCDE), (0x124, 1)]},
    "connected": {"code": 0, "message": "", "target": dict(PORT, nic="mlx5_1:1"), "qps": [(0x456, 7), (0x457, 8)]},
    "release": {"group_ids": [1, 2, 3]},
    "released": {},
}


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_round_trip(rdma_testing: ModuleType, kind: str) -> None:
    body = rdma_testing.encode_control(kind, SAMPLES[kind])
    assert rdma_testing.decode_control(body) == dict(SAMPLES[kind], kind=kind)


def test_refusals_carry_code_and_message(rdma_testing: ModuleType) -> None:
    body = rdma_testing.encode_control("connected", {"code": 12, "message": "no RDMA port mlx5_9:1"})
    assert rdma_testing.decode_control(body) == {"kind": "connected", "code": 12, "message": "no RDMA port mlx5_9:1"}
    body = rdma_testing.encode_control(
        "memory_info", {"code": 12, "message": "not registered", "nic": "", "addr": 0, "size": 0, "rkey": 0})
    assert rdma_testing.decode_control(body)["message"] == "not registered"


@pytest.mark.parametrize("kind", sorted(k for k in SAMPLES if SAMPLES[k]))
def test_every_truncation_is_rejected(rdma_testing: ModuleType, kind: str) -> None:
    body = rdma_testing.encode_control(kind, SAMPLES[kind])
    for cut in range(len(body)):
        with pytest.raises(ValueError):
            rdma_testing.decode_control(body[:cut])


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_trailing_bytes_are_rejected(rdma_testing: ModuleType, kind: str) -> None:
    body = rdma_testing.encode_control(kind, SAMPLES[kind])
    if kind == "hello":
        return  # Hello has no decoder beyond its header: nothing to trail
    with pytest.raises(ValueError, match="trailing"):
        rdma_testing.decode_control(body + b"\0")


def test_bad_header(rdma_testing: ModuleType) -> None:
    body = bytearray(rdma_testing.encode_control("get_memory", {"mem_id": 1}))
    bad_magic = bytes(b ^ 0xFF if i == 0 else b for i, b in enumerate(body))
    with pytest.raises(ValueError, match="magic"):
        rdma_testing.decode_control(bad_magic)
    bad_version = bytearray(body)
    bad_version[4:6] = struct.pack("<H", 99)
    with pytest.raises(ValueError, match="version 99"):
        rdma_testing.decode_control(bytes(bad_version))
    bad_type = bytearray(body)
    bad_type[6] = 200
    with pytest.raises(ValueError, match="unknown type 200"):
        rdma_testing.decode_control(bytes(bad_type))


def test_bounds_on_counts_and_strings(rdma_testing: ModuleType) -> None:
    with pytest.raises(ValueError, match="QPs outside"):
        rdma_testing.decode_control(rdma_testing.encode_control("connect", dict(SAMPLES["connect"], qps=[])))
    too_many = [(i, i) for i in range(65)]
    with pytest.raises(ValueError, match="65 QPs"):
        rdma_testing.decode_control(rdma_testing.encode_control("connect", dict(SAMPLES["connect"], qps=too_many)))
    # A string length field larger than the limit is refused before allocating.
    body = bytearray(rdma_testing.encode_control("get_memory", {"mem_id": 1}))[:7]
    body += struct.pack("<QI", 1, 1 << 30)  # connect: group id, then a 1 GiB "nic name"
    body[6] = 5
    with pytest.raises(ValueError, match="exceeds the limit"):
        rdma_testing.decode_control(bytes(body))
    with pytest.raises(ValueError, match="too large"):
        rdma_testing.decode_control(b"\0" * (rdma_testing.MAX_CONTROL_BYTES + 1))


def test_invalid_field_values(rdma_testing: ModuleType) -> None:
    for bad in ({"port": 0}, {"link_layer": 7}, {"active_mtu": 0}, {"active_mtu": 6}):
        body = rdma_testing.encode_control("connect", dict(SAMPLES["connect"], initiator=dict(PORT, **bad)))
        with pytest.raises(ValueError):
            rdma_testing.decode_control(body)
    body = rdma_testing.encode_control("memory_info", dict(SAMPLES["memory_info"], size=0))
    with pytest.raises(ValueError, match="incomplete"):
        rdma_testing.decode_control(body)
    body = rdma_testing.encode_control("memory_info", dict(SAMPLES["memory_info"], code=1))  # INIT is no reply code
    with pytest.raises(ValueError, match="invalid status code"):
        rdma_testing.decode_control(body)


def test_queue_pair_numbers_are_24_bit(rdma_testing: ModuleType) -> None:
    body = rdma_testing.encode_control("connect", dict(SAMPLES["connect"], qps=[(0xFF123456, 0xFFFFFFFF)]))
    assert rdma_testing.decode_control(body)["qps"] == [(0x123456, 0xFFFFFF)]


def test_random_garbage_never_crashes(rdma_testing: ModuleType) -> None:
    rng = random.Random(7)
    valid = [rdma_testing.encode_control(k, v) for k, v in SAMPLES.items()]
    for _ in range(3000):
        body = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            if body:
                body[rng.randrange(len(body))] = rng.randrange(256)
        try:
            rdma_testing.decode_control(bytes(body))
        except ValueError:
            pass
