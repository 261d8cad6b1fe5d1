"""Our libibverbs declarations (io/rdma/verbs_abi.hpp) against the real header:
tests/rdma/abi_check.cpp static_asserts every size, offset, constant and
function signature the backend relies on. Needs rdma-core's headers
(libibverbs-dev / rdma-core-devel) and a C++ compiler; skips without them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rdma_helpers import REPO


def _cxx() -> str | None:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def test_declarations_match_rdma_core(tmp_path: Path) -> None:
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    probe = tmp_path / "probe.cpp"
    probe.write_text("#include <infiniband/verbs.h>\n")
    if subprocess.run([cxx, "-fsyntax-only", str(probe)], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("rdma-core headers are not installed (apt install libibverbs-dev)")
    res = subprocess.run(
        [cxx, "-std=c++17", "-fsyntax-only", f"-I{REPO / 'mori_core' / 'csrc'}", str(Path(__file__).parent / "abi_check.cpp")],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
