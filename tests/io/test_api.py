"""API surface: descriptors, configs, the `mori` alias, argument validation."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

import mori_core
from mori_core.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
    XgmiBackendConfig,
)


def test_engine_desc_round_trip_and_ephemeral_port():
    e = IOEngine("desc-test", IOEngineConfig("127.0.0.1", 0))
    assert e.get_engine_desc().port == 0  # no listener before a network backend
    e.create_backend(BackendType.TCP)
    d = e.get_engine_desc()
    assert d.port > 0 and d.key == "desc-test" and d.host == "127.0.0.1" and d.pid > 0
    assert EngineDesc.unpack(d.pack()) == d
    assert pickle.loads(pickle.dumps(d)) == d
    e.create_backend(BackendType.TCP)  # duplicate: warning, no error
    # in a GPU build on a GPU host the XGMI backend comes along automatically
    expected = {BackendType.TCP, BackendType.XGMI} if mori_core._C.gpu_device_count() > 0 else {BackendType.TCP}
    assert set(e.backends()) == expected


def test_memory_desc_round_trip():
    e = IOEngine("mem-test", IOEngineConfig("127.0.0.1", 0))
    buf = np.zeros(1000, dtype=np.uint8)
    m = e.register_memory(buf.ctypes.data, 1000, -1, MemoryLocationType.CPU)
    assert (m.engine_key, m.size, m.loc, m.device_id, m.device_bus_id) == ("mem-test", 1000, MemoryLocationType.CPU, -1, "")
    assert m.data == buf.ctypes.data
    assert MemoryDesc.unpack(m.pack()) == m
    assert pickle.loads(pickle.dumps(m)) == m
    assert len(m.ipc_handle) == 64


@pytest.mark.parametrize("blob", [b"", b"\x00" * 3, b"garbage" * 10])
def test_unpack_rejects_garbage(blob):
    with pytest.raises(ValueError):
        EngineDesc.unpack(blob)
    with pytest.raises(ValueError):
        MemoryDesc.unpack(blob)


def test_unpack_rejects_truncation():
    e = IOEngine("trunc", IOEngineConfig("127.0.0.1", 0))
    p = e.get_engine_desc().pack()
    for n in range(len(p)):
        with pytest.raises(ValueError):
            EngineDesc.unpack(p[:n])
    with pytest.raises(ValueError, match="trailing"):
        EngineDesc.unpack(p + b"x")


def test_node_id_override(monkeypatch):
    code = "from mori_core.io import *; print(IOEngine('n', IOEngineConfig()).get_engine_desc().node_id)"
    out = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "MORI_NODE_ID": "node-42"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "node-42"


def test_config_defaults_match_mori():
    r = RdmaBackendConfig()
    assert (r.qp_per_transfer, r.post_batch_size, r.num_worker_threads, r.enable_notification, r.notif_per_qp) == (1, -1, -1, True, 1024)
    x = XgmiBackendConfig()
    assert (x.num_streams, x.num_events) == (64, 64)
    assert (x.proxy_blocks, x.proxy_max_bytes, x.proxy_idle_us) == (0, 1 << 20, 500)  # ours; off by default
    c = IOEngineConfig()
    assert (c.host, c.port) == ("", 0)
    t = TcpBackendConfig(num_connections=2)
    assert t.num_connections == 2 and t.enable_notification


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_connections=0), "num_connections"),
    (dict(num_connections=65), "num_connections"),
    (dict(chunk_bytes=10), "chunk_bytes"),
    (dict(op_timeout_ms=1), "op_timeout_ms"),
])
def test_bad_tcp_config_names_the_field(kwargs, match):
    e = IOEngine("badcfg", IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match=match):
        e.create_backend(BackendType.TCP, TcpBackendConfig(**kwargs))


@pytest.mark.skipif(not mori_core.build_info()["gpu"], reason="the XGMI backend is compiled only in GPU builds")
@pytest.mark.parametrize("kwargs,env,match", [
    (dict(proxy_blocks=-1), {}, r"XgmiBackendConfig\.proxy_blocks=-1 must be in \[0, 64\]"),
    (dict(proxy_blocks=65), {}, r"XgmiBackendConfig\.proxy_blocks=65 must be in \[0, 64\]"),
    (dict(proxy_blocks=4, proxy_max_bytes=100), {}, r"XgmiBackendConfig\.proxy_max_bytes=100 must be in \[4096, "),
    (dict(proxy_blocks=4, proxy_idle_us=5), {}, r"XgmiBackendConfig\.proxy_idle_us=5 must be in \[10, "),
    (dict(), {"MORI_IO_XGMI_PROXY_BLOCKS": "99"}, r"MORI_IO_XGMI_PROXY_BLOCKS=99 must be in \[0, 64\]"),
    (dict(), {"MORI_IO_XGMI_PROXY_IDLE_US": "0"}, r"MORI_IO_XGMI_PROXY_IDLE_US=0 must be in \[10, "),
])
def test_bad_xgmi_proxy_config_names_the_setting(monkeypatch, kwargs, env, match):
    """Checked before anything else when the backend is created (so also without a GPU)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    e = IOEngine("badproxy", IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match=match):
        e.create_backend(BackendType.XGMI, XgmiBackendConfig(**kwargs))
    assert BackendType.XGMI not in e.backends()


def test_register_memory_validation():
    e = IOEngine("reg", IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match="size"):
        e.register_memory(1234, 0, -1, MemoryLocationType.CPU)
    with pytest.raises(ValueError, match="ptr"):
        e.register_memory(0, 10, -1, MemoryLocationType.CPU)
    with pytest.raises(ValueError, match="mem_loc"):
        e.register_memory(1234, 10, -1, MemoryLocationType.Unknown)
    with pytest.raises(ValueError, match="ptr must be >= 0"):
        e.register_memory(-5, 10, -1, MemoryLocationType.CPU)
    if not mori_core.build_info()["gpu"]:
        with pytest.raises(RuntimeError, match="GPU memory needs"):
            e.register_memory(1234, 10, 0, MemoryLocationType.GPU)
    else:
        from mori_core import _C

        if _C.gpu_device_count() == 0:
            with pytest.raises(ValueError, match="device_id"):
                e.register_memory(1234, 10, 0, MemoryLocationType.GPU)


def test_register_torch_tensor():
    torch = pytest.importorskip("torch")
    e = IOEngine("torch", IOEngineConfig("127.0.0.1", 0))
    t = torch.arange(100, dtype=torch.float32)
    m = e.register_torch_tensor(t)
    assert m.size == 400 and m.data == t.data_ptr() and m.loc == MemoryLocationType.CPU
    with pytest.raises(ValueError, match="contiguous"):
        e.register_torch_tensor(torch.zeros(10, 10).t())


def test_unavailable_backends_raise_clearly():
    e = IOEngine("nobackend", IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match="XgmiBackendConfig"):
        e.create_backend(BackendType.XGMI, TcpBackendConfig())
    with pytest.raises(TypeError):
        e.create_backend("TCP")


def test_mori_alias_imports():
    import mori
    from mori.cpp import TransferStatus
    from mori.io import IOEngine as AliasEngine, StatusCode as AliasCode

    assert AliasEngine is IOEngine and AliasCode is StatusCode
    assert TransferStatus is mori_core.io.TransferStatus
    assert getattr(mori, "__mori_suite__", False)


def test_alias_never_shadows_an_installed_amd_mori(tmp_path):
    """Reproduce a site-packages holding both AMD's `mori` and our alias + .pth:
    the .pth appends the alias folder after site-packages, so AMD's package wins."""
    import os
    import shutil
    import sysconfig

    installed = sysconfig.get_paths()["purelib"]
    pth = os.path.join(installed, "mori_suite_alias.pth")
    assert os.path.exists(pth), "mori_suite_alias.pth is not installed"
    site_dir = tmp_path / "site-packages"
    (site_dir / "mori").mkdir(parents=True)
    (site_dir / "mori" / "__init__.py").write_text("AMD = True\n")
    shutil.copytree(os.path.join(installed, "mori_suite_alias"), site_dir / "mori_suite_alias")
    shutil.copy(pth, site_dir)
    code = (f"import site; site.addsitedir({str(site_dir)!r}); import mori; "
            "print(getattr(mori, 'AMD', False), getattr(mori, '__mori_suite__', False))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False"], out.stderr
    # without AMD's package the same site dir yields our alias
    shutil.rmtree(site_dir / "mori")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr
