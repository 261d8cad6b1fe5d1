"""vLLM general plugin of mori-suite: registers ``all2all_backend="mori_ep"``.

Declared in pyproject.toml as the ``vllm.general_plugins`` entry point ``mori_suite_ep``;
vLLM calls :func:`register` in every process it starts (API server, engine core, each
worker) before configs are parsed and models are built. To skip it, set ``VLLM_PLUGINS``
to a list of entry-point names without ``mori_suite_ep``.
"""

from __future__ import annotations

import threading

# vLLM minors whose internals the hooks were written against (0.30 and 0.32 are tested in
# CI-like runs; 0.31 and 0.33 were checked against their sources).
SUPPORTED_VLLM_MINORS = ((0, 30), (0, 31), (0, 32), (0, 33))

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Make this process's vLLM accept ``mori_ep`` and build mori-suite's classes for it.

    Idempotent (vLLM may call it several times per process). Raises RuntimeError when a
    hook point is missing in the installed vLLM -- vLLM logs the error with its traceback and
    ``mori_ep`` then stays an unknown backend, so nothing runs half-patched.
    """
    global _registered
    with _lock:
        if _registered:
            return
        import vllm

        from mori_integrations.vllm import hooks

        try:
            targets = hooks.resolve_targets()
        except (ImportError, AttributeError, RuntimeError) as exc:
            raise RuntimeError(
                f"mori-suite cannot register all2all_backend='mori_ep' with vLLM {vllm.__version__} "
                f"(written for {_supported()}): {exc}"
            ) from exc
        try:
            hooks.install_all(targets)
        except Exception as exc:  # e.g. pydantic refusing the schema rebuild
            raise RuntimeError(
                f"mori-suite could not install the mori_ep hooks into vLLM {vllm.__version__}: {exc}"
            ) from exc
        _registered = True
        if _minor(vllm.__version__) not in SUPPORTED_VLLM_MINORS:
            from vllm.logger import init_logger

            init_logger(__name__).warning(
                "mori_ep hooks installed into vLLM %s, outside the versions they were written for (%s)",
                vllm.__version__,
                _supported(),
            )


def _minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


def _supported() -> str:
    return ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM_MINORS)
