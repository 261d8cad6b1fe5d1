"""The ``mori_suite_kv`` entry point makes a fresh vLLM resolve ``MoriSuiteConnector`` (fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

PROBE = r"""
import json
from vllm.plugins import load_general_plugins
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from importlib.metadata import entry_points
load_general_plugins()
by_plugin = "MoriSuiteConnector" in KVConnectorFactory._registry
names = sorted(e.name for e in entry_points(group="vllm.general_plugins"))
from mori_integrations.vllm.kv_connector.register import register
register(); register()  # a second (and third) load is harmless
cfg = KVTransferConfig(kv_connector="MoriSuiteConnector", kv_role="kv_both",
                       kv_connector_extra_config={"backend": "tcp", "read_mode": True})
cls = KVConnectorFactory.get_connector_class(cfg)
path_cfg = KVTransferConfig(kv_connector="MoriSuiteConnector", kv_role="kv_both",
                            kv_connector_module_path="mori_integrations.vllm.kv_connector.connector")
print("PROBE_RESULT " + json.dumps({
    "by_plugin": by_plugin,
    "entry_point": "mori_suite_kv" in names,
    "cls": cls.__module__ + "." + cls.__name__,
    "hma": supports_hma(cls),
    "module_path_cls": KVConnectorFactory.get_connector_class(path_cfg) is cls,
    "piecewise": cls.requires_piecewise_for_cudagraph({}),
}))
"""


def _probe(**env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], env=dict(os.environ, VLLM_TARGET_DEVICE="cpu", **env),
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")]
    assert lines, f"probe failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("PROBE_RESULT "):])


def test_entry_point_registers_the_connector_once() -> None:
    r = _probe()
    assert r == {"by_plugin": True, "entry_point": True, "cls": "mori_integrations.vllm.kv_connector.connector.MoriSuiteConnector",
                 "hma": True, "module_path_cls": True, "piecewise": True}
