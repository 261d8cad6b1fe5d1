"""vLLM-Omni adapter of mori-suite: ``MoriTransferEngineConnector`` on our IO engine.

Installed as ``mori_integrations.vllm_omni``. The ``vllm.general_plugins``
entry point ``mori_suite_omni`` (:func:`plugin.register`) replaces vLLM-Omni's
stock Mori connector under its own name in every vLLM / vLLM-Omni process, so
stage YAMLs that name ``MoriTransferEngineConnector`` get this one.

Modules (one job each):

* ``settings``    — the connector ``extra`` dict, validated;
* ``protocol``    — control-plane messages (msgspec, bounded);
* ``pool``        — registered pool + first-fit allocator + buffers;
* ``outbox``      — sender-side payload table with in-flight pins and TTL;
* ``inbox``       — receiver-side pulls still in flight after their caller left;
* ``server`` / ``client`` — ZMQ listener and requester;
* ``transport``   — IO engine + pool + handshake; no vLLM-Omni import;
* ``connector``   — the vLLM-Omni connector class (imports vLLM-Omni);
* ``plugin``      — registration.

Importing this package is cheap: nothing heavy is imported until used.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MoriTransferEngineConnector", "OmniTransport", "ConnectorSettings"]

_LAZY = {
    "MoriTransferEngineConnector": "connector",
    "OmniTransport": "transport",
    "ConnectorSettings": "settings",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
