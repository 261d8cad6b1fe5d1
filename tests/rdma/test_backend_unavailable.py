"""create_backend(BackendType.RDMA) where RDMA cannot work: it must raise a
clear error (what is missing, what to install or set) — never crash — and the
engine keeps working over TCP. Each case runs in a fresh interpreter because
libibverbs is loaded once per process."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mori_core.io import BackendType, IOEngine, IOEngineConfig, RdmaBackendConfig, TcpBackendConfig

CREATE = """
from mori_core.io import BackendType, IOEngine, IOEngineConfig
e = IOEngine("probe", IOEngineConfig("127.0.0.1", 0))
try:
    e.create_backend(BackendType.RDMA)
    print("CREATED")
except Exception as ex:
    print(type(ex).__name__ + "|" + str(ex))
"""


def create_rdma(env: dict[str, str]) -> str:
    import os

    full = dict(os.environ)
    for k in list(full):
        if k.startswith(("MORI_", "FAKE_VERBS_")):
            del full[k]
    full.update(env)
    res = subprocess.run([sys.executable, "-c", CREATE], capture_output=True, text=True, timeout=60, env=full)
    assert res.returncode == 0, f"the interpreter died instead of raising: rc={res.returncode}\n{res.stderr}"
    return res.stdout.strip().splitlines()[-1]


def test_missing_library_says_what_to_install() -> None:
    out = create_rdma({"MORI_IBVERBS_LIBRARY": "/nonexistent/libibverbs.so.1"})
    kind, msg = out.split("|", 1)
    assert kind == "RuntimeError"
    assert "libibverbs could not be loaded" in msg and "/nonexistent/libibverbs.so.1" in msg
    assert "apt install libibverbs1" in msg and "MORI_IBVERBS_LIBRARY" in msg
    assert "BackendType.TCP" in msg


def test_wrong_library_names_the_missing_symbols() -> None:
    out = create_rdma({"MORI_IBVERBS_LIBRARY": "libc.so.6"})
    kind, msg = out.split("|", 1)
    assert kind == "RuntimeError"
    assert "lacks required symbols" in msg and "ibv_get_device_list" in msg


def test_this_machine_without_devices() -> None:
    """Whatever this machine lacks (the library, kernel support or a NIC), the message says so."""
    out = create_rdma({})
    if out == "CREATED":
        pytest.skip("this machine has a usable RDMA device")
    kind, msg = out.split("|", 1)
    assert kind == "RuntimeError"
    assert any(s in msg for s in ("libibverbs could not be loaded", "ibv_get_device_list failed",
                                  "found no RDMA device", "no usable RDMA port")), msg
    assert "BackendType.TCP" in msg


def test_ports_down(fake_verbs_library: str) -> None:
    out = create_rdma({"MORI_IBVERBS_LIBRARY": fake_verbs_library, "FAKE_VERBS_PORT_DOWN": "fake0"})
    assert out.startswith("RuntimeError|") and "no usable RDMA port among 1 device(s): fake0:1 (port DOWN)" in out


def test_everything_filtered_out(fake_verbs_library: str) -> None:
    out = create_rdma({"MORI_IBVERBS_LIBRARY": fake_verbs_library, "MORI_RDMA_DEVICES": "^fake0"})
    assert out.startswith("RuntimeError|") and "fake0:1 (excluded by MORI_RDMA_DEVICES='^fake0')" in out


def test_empty_gid_index(fake_verbs_library: str) -> None:
    out = create_rdma({"MORI_IBVERBS_LIBRARY": fake_verbs_library, "MORI_IB_GID_INDEX": "3"})
    assert out.startswith("RuntimeError|") and "MORI_IB_GID_INDEX=3 is an empty GID entry on fake0:1" in out


def test_fake_device_is_accepted(fake_verbs_library: str) -> None:
    # The same probe succeeds with a device: the failures above are about the device, not the probe.
    assert create_rdma({"MORI_IBVERBS_LIBRARY": fake_verbs_library}) == "CREATED"


def test_bad_config_is_a_value_error_before_any_device_access() -> None:
    e = IOEngine("cfg", IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match="qp_per_transfer=0"):
        e.create_backend(BackendType.RDMA, RdmaBackendConfig(qp_per_transfer=0))
    with pytest.raises(ValueError, match="RdmaBackendConfig"):
        e.create_backend(BackendType.RDMA, TcpBackendConfig())
    assert e.backends() == []


FALLBACK = """
import numpy as np
from mori_core.io import BackendType, IOEngine, IOEngineConfig, MemoryLocationType, StatusCode
a, b = IOEngine("a", IOEngineConfig("127.0.0.1", 0)), IOEngine("b", IOEngineConfig("127.0.0.1", 0))
for e in (a, b):
    try:
        e.create_backend(BackendType.RDMA)
    except RuntimeError:
        pass
    e.create_backend(BackendType.TCP)
a.register_remote_engine(b.get_engine_desc())
src = np.arange(4096, dtype=np.uint8); dst = np.zeros(4096, dtype=np.uint8)
ma = a.register_memory(src.ctypes.data, src.nbytes, -1, MemoryLocationType.CPU)
mb = b.register_memory(dst.ctypes.data, dst.nbytes, -1, MemoryLocationType.CPU)
s = a.write(ma, 0, mb, 0, 4096, a.allocate_transfer_uid())
print(a.backends(), a.route_of(ma, mb), s.WaitFor(10000), bool((src == dst).all()))
"""


def test_engine_falls_back_to_tcp_without_libibverbs() -> None:
    import os

    env = dict(os.environ, MORI_IBVERBS_LIBRARY="/nonexistent/libibverbs.so.1")
    res = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[<BackendType.TCP: 3>] BackendType.TCP StatusCode.SUCCESS True"


def test_extension_does_not_link_libibverbs() -> None:
    import mori_core._C as C

    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    dyn = subprocess.run([readelf, "-d", str(Path(C.__file__))], capture_output=True, text=True, timeout=60).stdout
    needed = [line for line in dyn.splitlines() if "(NEEDED)" in line]
    assert needed, "readelf found no NEEDED entries at all"
    assert not any("ibverbs" in line or "rdmacm" in line for line in needed), needed
