"""SGLang's MoRI knobs as the adapter reads them (issue #29 item 6), one test per knob.

Stock sglang 0.5.23's meaning (srt/environ.py, disaggregation/mori/conn.py):
``SGLANG_MORI_TRANSFER_TIMEOUT_MS`` -- per-transfer SLA, 0 = none; ``SGLANG_MORI_SEND_AUX_RDMA``
-- aux buffers written by the engine instead of copied over ZMQ; ``SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT``
-- bound on creating the IO engine (60 s).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("sglang")

from mori_integrations.sglang import io_setup  # noqa: E402


@pytest.mark.parametrize("value, seconds", [(None, io_setup.NO_LIMIT_S), ("0", io_setup.NO_LIMIT_S),
                                            ("-5", io_setup.NO_LIMIT_S), ("2500", 2.5)])
def test_transfer_timeout_ms_zero_means_no_limit_as_in_stock(monkeypatch, value, seconds) -> None:
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "7")  # what main fell back to for 0
    if value is None:
        monkeypatch.delenv("SGLANG_MORI_TRANSFER_TIMEOUT_MS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_MORI_TRANSFER_TIMEOUT_MS", value)
    assert io_setup.transfer_timeout_s() == seconds
    assert io_setup.NO_LIMIT_S >= 365 * 86400


@pytest.mark.parametrize("value, refused", [(None, False), ("1", False), ("true", False), ("0", True),
                                            ("false", True)])
def test_send_aux_rdma_false_is_refused_with_the_reason(monkeypatch, value, refused) -> None:
    if value is None:
        monkeypatch.delenv("SGLANG_MORI_SEND_AUX_RDMA", raising=False)
    else:
        monkeypatch.setenv("SGLANG_MORI_SEND_AUX_RDMA", value)
    note = io_setup.aux_rdma_note()
    if refused:
        assert note is not None and "SGLANG_MORI_SEND_AUX_RDMA=0 is not applied" in note and "IO engine" in note
    else:
        assert note is None


def test_engine_init_timeout_bounds_engine_creation(monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT", "30")
    setup = io_setup.create_engine_bounded("knob-test", "127.0.0.1", gpu_memory=False,
                                           rdma=io_setup.RdmaTuning())  # a real engine, well within the bound
    assert setup.engine.get_engine_desc().port > 0
    del setup

    def stuck(*_, **__):  # the IO engine side: e.g. RDMA device initialisation that never returns
        time.sleep(5)

    monkeypatch.setattr(io_setup, "create_engine", stuck)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT", "1")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT=1"):
        io_setup.create_engine_bounded("knob-test-2", "127.0.0.1", gpu_memory=False, rdma=io_setup.RdmaTuning())
    assert time.monotonic() - t0 < 4


def test_real_managers_apply_the_knobs(cluster) -> None:
    """The session cluster's prefill runs with the stock defaults plus SGLANG_MORI_SEND_AUX_RDMA=0."""
    from scenario import deploy, layout

    dep = deploy(cluster, layout(mla=False, page_size=16), 1, 1)
    try:
        info = dep.prefill[0].call("manager_info", name=dep.name)
        assert info["transfer_timeout_s"] == io_setup.NO_LIMIT_S  # SGLANG_MORI_TRANSFER_TIMEOUT_MS unset = 0
        assert "SGLANG_MORI_SEND_AUX_RDMA=0 is not applied" in dep.prefill[0].log()
    finally:
        dep.teardown()
