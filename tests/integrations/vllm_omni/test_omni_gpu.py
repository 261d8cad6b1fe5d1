"""The connector's data path on GPUs: CUDA pools in two processes on two GPUs.

Runs on the GPU machine (tools/gpu/omni.sh) where vLLM-Omni is not installed,
so it drives the connector's transport (the exact code under
``MoriTransferEngineConnector.put/get``) without the vLLM-Omni class around it.
Same-node GPU->GPU pairs go over the XGMI backend when the build has it; a CPU
pool on either side goes over TCP (GPU memory staged by the TCP backend).
"""

from __future__ import annotations

import pytest

from omni_gpu_workers import GpuStage
from omni_workers import find_free_base

pytestmark = pytest.mark.multigpu

SIZES = [3305, 1_611_712, 64 << 20]


def _extra(port: int, device: str) -> dict:
    return {"host": "127.0.0.1", "role": "dual", "zmq_port": port, "memory_pool_device": device,
            "memory_pool_size": "160M", "backend_type": "auto"}


@pytest.fixture(scope="module")
def stages():
    base = find_free_base(3)
    made = {}
    try:
        for i, device in enumerate(("cuda:0", "cuda:1", "cpu")):
            made[device] = GpuStage(device, _extra(base + i, device))
        yield made
    finally:
        for stage in made.values():
            stage.stop()


@pytest.mark.parametrize("nbytes", SIZES, ids=["3.3KB", "1.6MB", "64MB"])
@pytest.mark.parametrize("src, dst", [("cuda:0", "cuda:1"), ("cpu", "cuda:1"), ("cuda:0", "cpu")],
                         ids=["gpu0-gpu1", "cpu-gpu1", "gpu0-cpu"])
def test_payload_between_pools_on_two_gpus(stages, src: str, dst: str, nbytes: int) -> None:
    sender, receiver = stages[src], stages[dst]
    key = f"{src}-{dst}-{nbytes}"
    before = sender.call("stats")["routes"]
    # The payload is a CUDA tensor on GPU 0 in every case; a CPU pool copies it device -> host.
    put = sender.call("offer", key=key, nbytes=nbytes, seed=nbytes % 101, src_device="cuda:0")
    got = receiver.call("fetch", key=key, address=sender.info["address"], size=put["size"])
    assert got["found"] and got["size"] == nbytes
    assert got["digest"] == put["digest"]
    assert got["device"] == receiver.info["pool_device"]
    routes = sender.call("stats")["routes"]
    used = {k: routes.get(k, 0) - before.get(k, 0) for k in routes if routes.get(k, 0) != before.get(k, 0)}
    # XGMI serves the initiator's GPU or CPU memory -> a GPU pool in another
    # process; a remote CPU pool is only reachable over TCP.
    expected = "XGMI" if dst.startswith("cuda") and "xgmi" in sender.info["backends"] else "TCP"
    assert used == {expected: 1}, (used, sender.info)
    assert sender.call("stats")["pool_used_bytes"] == 0 and receiver.call("stats")["pool_used_bytes"] == 0


def test_gpu_to_gpu_goes_over_xgmi(stages) -> None:
    sender = stages["cuda:0"]
    if "xgmi" not in sender.info["backends"]:
        pytest.skip(f"XGMI backend not available in this build: {sender.info['unavailable'].get('xgmi')}")
    put = sender.call("offer", key="xgmi", nbytes=1_611_712, seed=7, src_device="cuda:0")
    got = stages["cuda:1"].call("fetch", key="xgmi", address=sender.info["address"], size=put["size"])
    assert got["found"] and got["digest"] == put["digest"]
    assert sender.call("stats")["routes"].get("XGMI", 0) >= 1
