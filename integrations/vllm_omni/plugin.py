"""``vllm.general_plugins`` entry point: put our connector behind vLLM-Omni's Mori name.

vLLM runs general plugins in every process (API server, engine core, workers)
and vLLM-Omni 0.30 runs them again from ``load_omni_general_plugins``, so this
must be cheap, idempotent, and never raise (a raising plugin aborts vLLM).

We replace the factory's ``"MoriTransferEngineConnector"`` entry instead of
registering a new name: vLLM-Omni gates its port, role and endpoint wiring on
that *name* (``TRANSFER_ENGINE_CONNECTOR_NAMES``), so only the stock name gets
it. ``register_connector`` refuses existing names, hence the direct write to
the factory's registry dict.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

__all__ = ["CONNECTOR_NAME", "register", "create_connector", "is_registered"]

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "MoriTransferEngineConnector"


def create_connector(config: dict[str, Any]) -> Any:
    """Factory constructor: build our connector from a connector ``extra`` dict."""
    from .connector import MoriTransferEngineConnector  # noqa: PLC0415 (imports vLLM-Omni)

    return MoriTransferEngineConnector(config)


create_connector.mori_suite = True  # marks our constructor in the factory registry


def is_registered() -> bool:
    """True when vLLM-Omni's factory builds our connector for the Mori name."""
    factory = _factory()
    return factory is not None and getattr(factory._registry.get(CONNECTOR_NAME), "mori_suite", False)


def _factory() -> Any:
    if importlib.util.find_spec("vllm_omni") is None:
        return None
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory  # noqa: PLC0415

    return OmniConnectorFactory


def register() -> None:
    """Make vLLM-Omni's factory build mori-suite's connector (idempotent, never raises)."""
    try:
        factory = _factory()
        if factory is None:
            return  # plain vLLM without vLLM-Omni: nothing to do
        if getattr(factory._registry.get(CONNECTOR_NAME), "mori_suite", False):
            return
        factory._registry[CONNECTOR_NAME] = create_connector
        logger.info("mori-suite: %s now runs on mori-suite's IO engine", CONNECTOR_NAME)
        try:
            from .core_import import load_core  # noqa: PLC0415

            load_core()
        except Exception as exc:  # reported again, as an error, when a connector is built
            logger.warning("mori-suite: %s", exc)
    except Exception:  # never abort vLLM start-up because of this plugin
        logger.exception("mori-suite: registering %s with vLLM-Omni failed", CONNECTOR_NAME)
