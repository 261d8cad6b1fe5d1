"""SGLang PD-disaggregation transfer backend on mori-suite's IO engine.

After ``pip install mori-suite`` next to stock ``sglang==0.5.23``, SGLang's
plugin loader runs :func:`mori_integrations.sglang.plugin.register` (entry point
group ``sglang.srt.plugins``), and ``--disaggregation-transfer-backend mori``
then builds the classes exported here instead of SGLang's in-tree AMD backend:

* :class:`MoriKVManager`   - one per scheduler rank: IO engine, registered KV /
  aux / state memory, control threads, transfer workers;
* :class:`MoriKVSender`    - one per request on the prefill side;
* :class:`MoriKVReceiver`  - one per request on the decode side;
* :class:`MoriKVBootstrapServer` - the prefill's rank registry (HTTP).

Bytes move only through ``mori_core.io`` (XGMI / RDMA / TCP, chosen per pair by
the engine). The names are resolved lazily so that importing this package (the
plugin does, in every SGLang process) does not import SGLang's scheduler stack.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)

__all__ = [
    "MoriKVBootstrapServer",
    "MoriKVManager",
    "MoriKVReceiver",
    "MoriKVSender",
    "SUPPORTED_SGLANG_VERSIONS",
]

_LAZY = {
    "MoriKVManager": "mori_integrations.sglang.manager",
    "MoriKVSender": "mori_integrations.sglang.sender",
    "MoriKVReceiver": "mori_integrations.sglang.receiver",
    "MoriKVBootstrapServer": "mori_integrations.sglang.bootstrap_server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
