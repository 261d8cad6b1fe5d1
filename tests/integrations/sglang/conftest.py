"""Fixtures of the SGLang adapter tests: real sglang==0.5.23 processes over the TCP backend."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Dict, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from pd_cluster import Host, start_hosts  # noqa: E402

CLUSTER_ENV = {"MORI_IO_AUTH_SECRET": "sglang-suite-secret", "SGLANG_MORI_SEND_AUX_RDMA": "0"}

# Outside the venv of .ci/venv_sglang.sh (sglang==0.5.23 + mori-suite) there is nothing to test,
# except the GPU transfer test (test_gpu_*), which plays SGLang's part itself (no SGLang on the GPU machine).
if importlib.util.find_spec("mori_integrations") is None:
    collect_ignore_glob = ["test_*.py"]
elif importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_[!g]*.py"]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Host]]:
    """Bootstrap host B, prefill hosts P0/P1 and decode hosts D0/D1, shared by the transfer tests.

    With a shared secret (registrations with the bootstrap server and IO handshakes are
    authenticated) and ``SGLANG_MORI_SEND_AUX_RDMA=0`` set (refused with a log line, see test_knobs).
    """
    hosts = start_hosts(["B", "P0", "P1", "D0", "D1"], tmp_path_factory.mktemp("pd_hosts"), CLUSTER_ENV)
    try:
        yield hosts
    finally:
        for h in hosts.values():
            h.close()
