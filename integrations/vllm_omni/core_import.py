"""Import of the compiled mori-suite core, with one clear error when it is missing.

The connector is useless without ``mori_core._C`` (the IO engine). Importing it
lazily and turning any failure into :class:`CoreUnavailableError` means a
broken install surfaces once, at connector construction, with the reason and
the fix — instead of as a bare ``ImportError`` from deep inside a transfer.
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["CoreUnavailableError", "load_core"]


class CoreUnavailableError(RuntimeError):
    """The compiled core of mori-suite (``mori_core._C``) cannot be imported."""


def load_core() -> ModuleType:
    """Return the ``mori_core.io`` module or raise :class:`CoreUnavailableError`.

    Raises:
        CoreUnavailableError: with the original import error and how to fix it.
    """
    try:
        import mori_core.io as io_module  # noqa: PLC0415 (deliberately lazy)
    except ImportError as exc:  # missing package, missing/ABI-broken _C.so, ...
        raise CoreUnavailableError(
            "MoriTransferEngineConnector (mori-suite) needs the compiled core `mori_core._C`, "
            f"which could not be imported: {exc}. Install mori-suite for this Python/platform "
            "(`pip install mori-suite`, or `pip install --no-build-isolation .` in the mori-suite "
            "checkout) in the environment that runs vLLM-Omni."
        ) from exc
    return io_module
