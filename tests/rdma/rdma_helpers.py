"""Helpers shared by the RDMA backend tests (imported as a plain module)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=1)
def rdma_available() -> tuple[bool, str]:
    """(True, "") when an RDMA backend can be created here, else (False, why)."""
    from mori_core.io import BackendType, IOEngine, IOEngineConfig

    engine = IOEngine("rdma-probe", IOEngineConfig("127.0.0.1", 0))
    try:
        engine.create_backend(BackendType.RDMA)
    except RuntimeError as e:
        return False, str(e)
    finally:
        del engine
    return True, ""


def run_pytest(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Runs pytest in a fresh interpreter (libibverbs is loaded once per process)."""
    full_env = dict(os.environ)
    full_env.update(env)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(REPO))
