"""The installed entry point makes ``--disaggregation-transfer-backend mori`` build our classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import argparse, json, sys
from sglang.srt.plugins import load_plugins
load_plugins()  # what launch_server / the scheduler processes do first
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                          "--disaggregation-transfer-backend", "mori"])
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
backend = TransferBackend(args.disaggregation_transfer_backend)
out = {}
for kind in (KVClassType.MANAGER, KVClassType.SENDER, KVClassType.RECEIVER, KVClassType.BOOTSTRAP_SERVER):
    try:
        cls = get_kv_class(backend, kind)
        out[kind.name] = cls.__module__ + "." + cls.__qualname__
    except Exception as e:
        out[kind.name] = "error: " + type(e).__name__
out["stock_conn_imported"] = "sglang.srt.disaggregation.mori.conn" in sys.modules
print("RESULT " + json.dumps(out))
"""


def _probe(extra_env: dict) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **extra_env}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_mori_backend_resolves_to_mori_suite_in_fresh_interpreter() -> None:
    got = _probe({})
    assert got == {
        "MANAGER": "mori_integrations.sglang.manager.MoriKVManager",
        "SENDER": "mori_integrations.sglang.sender.MoriKVSender",
        "RECEIVER": "mori_integrations.sglang.receiver.MoriKVReceiver",
        "BOOTSTRAP_SERVER": "mori_integrations.sglang.bootstrap_server.MoriKVBootstrapServer",
        "stock_conn_imported": False,
    }


def test_without_the_plugin_sglang_uses_its_own_backend() -> None:
    # Control: excluding our entry point (SGLANG_PLUGINS allow-list) changes the answer,
    # so the test above observes the plugin and not something always true.
    got = _probe({"SGLANG_PLUGINS": "some_other_plugin"})
    assert not got["MANAGER"].startswith("mori_integrations"), got
