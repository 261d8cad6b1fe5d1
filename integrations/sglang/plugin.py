"""``sglang.srt.plugins`` entry point: make ``--disaggregation-transfer-backend mori``
build mori-suite's classes.

SGLang 0.5.23 resolves a backend in ``sglang.srt.disaggregation.utils.get_kv_class``
with a lazy ``from sglang.srt.disaggregation.mori import MoriKVManager, ...``.
:func:`register` installs this package under that module name, so every
``get_kv_class(TransferBackend.MORI, ...)`` in the process returns our classes and
SGLang's own ``disaggregation/mori/conn.py`` (which needs AMD's ``mori`` package)
is never imported. Nothing of SGLang is patched or wrapped; the enum value, the
CLI choice and every ``"mori"`` name check stay SGLang's own.

It also readies ``--moe-a2a-backend mori`` (SGLang's stock MORI token dispatcher over
the ``mori`` alias) on NVIDIA: :func:`mori_integrations.sglang.moe_ep.install` gives
``moriep.py`` the dispatch quantisers it otherwise imports from ROCm's aiter. A failure
there is logged and leaves the PD backend registered.

SGLang's loader logs and swallows a plugin's exception. So that a plugin that
cannot apply never lets the stock backend run silently, a failed registration
installs a module under the same name whose every attribute access raises the
reason: the first use of the backend then fails at manager construction with
that message.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types
from typing import NoReturn

from mori_integrations.sglang import SUPPORTED_SGLANG_VERSIONS

logger = logging.getLogger(__name__)

STOCK_MODULE = "sglang.srt.disaggregation.mori"
PLUGIN_PACKAGE = "mori_integrations.sglang"


class PluginError(RuntimeError):
    """The mori-suite SGLang plugin cannot apply in this process."""


def _sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as e:
        raise PluginError("mori-suite SGLang plugin: the sglang package is not installed") from e


def _install_failure_stub(reason: str) -> None:
    """Make any later use of the mori backend raise ``reason`` instead of running stock code."""

    def _fail(name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"--disaggregation-transfer-backend mori is unavailable: {reason}")

    stub = types.ModuleType(STOCK_MODULE, doc=f"mori-suite plugin failed: {reason}")
    stub.__getattr__ = _fail  # type: ignore[method-assign]
    sys.modules[STOCK_MODULE] = stub


def _check_preconditions() -> None:
    version = _sglang_version()
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise PluginError(
            f"mori-suite's SGLang adapter supports sglang=={' / '.join(SUPPORTED_SGLANG_VERSIONS)}, "
            f"found sglang=={version}. Install a matching sglang, or exclude this plugin with "
            "SGLANG_PLUGINS=<other plugins> to use SGLang's in-tree mori backend."
        )
    stock = sys.modules.get(STOCK_MODULE)
    if stock is not None and getattr(stock, "__name__", "") not in (PLUGIN_PACKAGE, STOCK_MODULE):
        raise PluginError(f"{STOCK_MODULE} is already bound to {stock!r}")
    if f"{STOCK_MODULE}.conn" in sys.modules:
        # Classes from the stock module may already be held by importers; replacing
        # the module now would leave two implementations in one process.
        raise PluginError(
            f"SGLang's in-tree {STOCK_MODULE}.conn was imported before the plugin loaded; "
            "load plugins first (sglang.srt.plugins.load_plugins)"
        )


def register() -> None:
    """Entry point: route SGLang's ``mori`` transfer backend to mori-suite.

    Idempotent. Raises :class:`PluginError` (after installing a stub that makes the
    backend fail with the same message) when the plugin cannot apply.
    """
    try:
        _check_preconditions()
        package = importlib.import_module(PLUGIN_PACKAGE)
        sys.modules[STOCK_MODULE] = package
        parent = sys.modules.get(STOCK_MODULE.rpartition(".")[0])
        if parent is not None:
            setattr(parent, "mori", package)
    except Exception as e:
        reason = str(e)
        _install_failure_stub(reason)
        logger.error("mori-suite SGLang plugin could not apply: %s", reason)
        raise PluginError(reason) from e
    logger.info(
        "mori-suite SGLang plugin registered: --disaggregation-transfer-backend mori -> %s "
        "(transfers through mori_core.io)",
        PLUGIN_PACKAGE,
    )
    _register_moe()


def _register_moe() -> None:
    """Ready SGLang's MORI MoE dispatcher (see :mod:`mori_integrations.sglang.moe_ep`)."""
    try:
        from mori_integrations.sglang import moe_ep

        logger.info("mori-suite SGLang plugin: %s", moe_ep.install())
    except Exception as e:  # PD keeps working; --moe-a2a-backend mori then fails in SGLang's own code
        logger.error(
            "mori-suite SGLang plugin could not ready --moe-a2a-backend mori (%s: %s); on NVIDIA SGLang's MORI "
            "dispatcher will then fail for want of aiter",
            type(e).__name__,
            e,
        )


def is_active() -> bool:
    """True when ``sglang.srt.disaggregation.mori`` resolves to this package."""
    module = sys.modules.get(STOCK_MODULE)
    return module is not None and getattr(module, "__name__", "") == PLUGIN_PACKAGE
