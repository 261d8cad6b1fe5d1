"""Page-exact KV / aux / state transfers between real prefill and decode managers.

Each configuration runs SGLang 0.5.23's real Common* machinery and bootstrap
server in separate processes, with mori_core.io over the TCP backend and CPU
buffers; the decode bytes are compared with the prefill bytes page by page
(head slices for MHA with different TP sizes), and pages outside the request
must stay untouched.
"""

from __future__ import annotations

import pytest

from scenario import deploy, layout, new_request, run_request

TOPOLOGIES = [(1, 1), (2, 1), (1, 2)]


@pytest.mark.parametrize("ptp,dtp", TOPOLOGIES, ids=[f"tp{p}to{d}" for p, d in TOPOLOGIES])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_kv_and_aux_page_exact(cluster, mla: bool, page_size: int, ptp: int, dtp: int) -> None:
    dep = deploy(cluster, layout(mla=mla, page_size=page_size), ptp, dtp)
    try:
        for seed in range(2):  # a second request reuses the established connections
            run_request(dep, new_request(dep, seed=seed))
    finally:
        dep.teardown()


def test_hybrid_state_mamba_and_swa(cluster) -> None:
    dep = deploy(cluster, layout(mla=False, page_size=16, state=("mamba", "swa")), 1, 1)
    try:
        run_request(dep, new_request(dep, seed=7))
    finally:
        dep.teardown()
