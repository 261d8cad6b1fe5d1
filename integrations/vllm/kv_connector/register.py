"""``vllm.general_plugins`` entry point ``mori_suite_kv``: registers ``MoriSuiteConnector``.

vLLM runs general plugins in every process it starts (API server, engine core, each
worker) before configs are built, so ``--kv-transfer-config
'{"kv_connector":"MoriSuiteConnector",...}'`` resolves in all of them. Registration is
lazy (the connector module is imported when a config names it) and idempotent. To skip
it, list the other entry points in ``VLLM_PLUGINS``; ``kv_connector_module_path``
(``mori_integrations.vllm.kv_connector.connector``) works without the plugin too.
"""

from __future__ import annotations

import logging
import threading

from mori_integrations.vllm.kv_connector.config import CONNECTOR_NAME

__all__ = ["CONNECTOR_MODULE", "register"]

CONNECTOR_MODULE = "mori_integrations.vllm.kv_connector.connector"
_lock = threading.Lock()


def register() -> None:
    """Register ``MoriSuiteConnector`` with vLLM's ``KVConnectorFactory`` (a second call does nothing)."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from mori_integrations.vllm.plugin import SUPPORTED_VLLM_MINORS, _minor, _supported

    with _lock:
        _log_like_vllm()
        if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
            return
        try:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
        except ValueError:  # registered meanwhile by someone else
            return
    if _minor(vllm.__version__) not in SUPPORTED_VLLM_MINORS:
        from vllm.logger import init_logger

        init_logger(__name__).warning(
            "%s registered with vLLM %s, outside the versions it was written for (%s)",
            CONNECTOR_NAME,
            vllm.__version__,
            _supported(),
        )


def _log_like_vllm() -> None:
    """Send the connector's log records through vLLM's handlers (vLLM configures only its own logger)."""
    ours = logging.getLogger("mori_integrations")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
