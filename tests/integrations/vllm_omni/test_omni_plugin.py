"""Registration through the real plugin loaders of vLLM and vLLM-Omni, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, logging
from importlib.metadata import entry_points
eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
stock = OmniConnectorFactory._registry["MoriTransferEngineConnector"]
from vllm_omni.plugins import load_omni_general_plugins
load_omni_general_plugins()   # vLLM-Omni 0.30 runs vLLM's general plugins from here
ours = OmniConnectorFactory._registry["MoriTransferEngineConnector"]
from mori_integrations.vllm_omni import plugin
plugin.register(); plugin.register()   # idempotent
again = OmniConnectorFactory._registry["MoriTransferEngineConnector"]
from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
conn = OmniConnectorFactory.create_connector(ConnectorSpec("MoriTransferEngineConnector",
                                             {"role": "receiver", "memory_pool_size": "1M"}))
print("RESULT " + json.dumps({
    "entry_point": eps.get("mori_suite_omni"),
    "stock_replaced": stock is not ours,
    "ours": getattr(ours, "mori_suite", False),
    "idempotent": again is ours,
    "names": OmniConnectorFactory.list_registered_connectors(),
    "cls": type(conn).__module__,
    "raw": conn.supports_raw_data,
}))
conn.close()
"""


def test_vllm_plugin_loader_installs_our_connector_under_the_stock_name() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert res["entry_point"] == "mori_integrations.vllm_omni.plugin:register"
    assert res["stock_replaced"] and res["ours"] and res["idempotent"]
    assert res["names"].count("MoriTransferEngineConnector") == 1 and "MooncakeTransferEngineConnector" in res["names"]
    assert res["cls"] == "mori_integrations.vllm_omni.connector" and res["raw"] is True
