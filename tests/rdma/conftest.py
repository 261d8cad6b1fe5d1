"""Fixtures of the RDMA backend tests.

* ``rdma_testing``: the backend's pure logic (``mori_core._C._rdma_testing``).
* ``fake_verbs_library``: tests/rdma/fake_verbs/fake_verbs.cpp compiled into a
  shared library — a software libibverbs that lets the real backend run
  without a NIC (see that file for what it models).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from rdma_helpers import REPO

FAKE_SOURCE = Path(__file__).resolve().parent / "fake_verbs" / "fake_verbs.cpp"


@pytest.fixture(scope="session")
def rdma_testing() -> ModuleType:
    """The internal test module; fails loudly if the extension lacks the hook."""
    from mori_core import _C

    mod = getattr(_C, "_rdma_testing", None)
    if mod is None:
        pytest.fail(
            "mori_core._C._rdma_testing is missing: bindings/module.cpp must call "
            "RegisterRdmaTesting (see docs/rdma.md, 'Test hooks')"
        )
    return mod


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="session")
def fake_verbs_library(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of the compiled software verbs provider (skips without a C++ compiler)."""
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler to build tests/rdma/fake_verbs (set CXX)")
    out = tmp_path_factory.mktemp("fake_verbs") / "libfakeverbs.so"
    cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{REPO / 'mori_core' / 'csrc'}", str(FAKE_SOURCE),
           "-o", str(out), "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"building the fake verbs provider failed:\n{res.stderr}"
    return str(out)
