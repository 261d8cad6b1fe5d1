"""RdmaBackendConfig + environment overrides, their validation, send-queue
admission and the texts of completion errors (no NIC needed)."""

from __future__ import annotations

import threading
import time
from types import ModuleType

import pytest

from mori_core.io import PollCqMode, RdmaBackendConfig

ENV_KNOBS = [
    "MORI_IO_QP_PER_TRANSFER", "MORI_IO_POST_BATCH_SIZE", "MORI_IO_NUM_WORKER_THREADS", "MORI_IO_POLL_CQ_MODE",
    "MORI_IO_ENABLE_NOTIFICATION", "MORI_IO_ENABLE_CHUNKING", "MORI_IO_CHUNK_BYTES", "MORI_IO_MAX_CHUNKS",
    "MORI_IO_NUM_NICS_PER_TRANSFER", "MORI_IO_QP_MAX_SEND_WR", "MORI_IO_QP_MAX_CQE", "MORI_IO_QP_MAX_SGE",
    "MORI_IO_QP_MAX_MSG_SGE", "MORI_RDMA_DEVICES", "MORI_IB_GID_INDEX", "MORI_IB_PATH_MTU", "MORI_IO_SL",
    "MORI_RDMA_SL", "MORI_IO_TC", "MORI_RDMA_TC", "MORI_IO_QP_TIMEOUT", "MORI_IO_QP_RETRY_CNT",
    "MORI_IO_QP_RNR_RETRY", "MORI_IO_QP_MIN_RNR_TIMER", "MORI_IO_QP_MAX_INLINE_DATA",
    "MORI_IB_ENABLE_RELAXED_ORDERING", "MORI_ENABLE_DMABUF_REG", "MORI_IO_RDMA_NIC_IDX",
    "MORI_IO_SQ_BACKOFF_TIMEOUT_US", "MORI_IO_CP_TIMEOUT_MS", "MORI_IO_QP_STALL_TIMEOUT_MS", "MORI_IO_SYSFS_ROOT",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ENV_KNOBS:
        monkeypatch.delenv(k, raising=False)


def test_defaults_match_mori(rdma_testing: ModuleType) -> None:
    s = rdma_testing.resolve_settings(RdmaBackendConfig())
    assert (s["qp_per_transfer"], s["post_batch_size"], s["num_worker_threads"], s["worker_threads"]) == (1, -1, -1, 0)
    assert s["poll_cq_mode"] == int(PollCqMode.POLLING)
    assert s["enable_notification"] and s["notif_per_qp"] == 1024
    assert (s["max_send_wr"], s["max_cqe"], s["max_sge"]) == (8192, 16384, 4)
    assert (s["qp_timeout"], s["retry_count"], s["rnr_retry"]) == (14, 7, 6)
    assert s["dmabuf"] and not s["relaxed_ordering"] and s["gid_index"] == -1


def test_environment_overrides_the_config(rdma_testing: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {
        "MORI_IO_QP_PER_TRANSFER": "4", "MORI_IO_POST_BATCH_SIZE": "32", "MORI_IO_NUM_WORKER_THREADS": "3",
        "MORI_IO_POLL_CQ_MODE": "event", "MORI_IO_ENABLE_NOTIFICATION": "0", "MORI_IO_CHUNK_BYTES": "128K",
        "MORI_IO_QP_MAX_SEND_WR": "1024", "MORI_IO_QP_MAX_MSG_SGE": "2", "MORI_RDMA_DEVICES": "^mlx5_1",
        "MORI_IB_GID_INDEX": "3", "MORI_IB_PATH_MTU": "1024", "MORI_RDMA_TC": "106", "MORI_IO_SL": "3",
        "MORI_ENABLE_DMABUF_REG": "0",
    }.items():
        monkeypatch.setenv(k, v)
    s = rdma_testing.resolve_settings(RdmaBackendConfig(qp_per_transfer=2))
    assert (s["qp_per_transfer"], s["post_batch_size"], s["worker_threads"]) == (4, 32, 3)
    assert s["poll_cq_mode"] == int(PollCqMode.EVENT) and not s["enable_notification"]
    assert s["chunk_bytes"] == 128 * 1024 and s["max_send_wr"] == 1024 and s["max_sge"] == 2
    assert (s["devices"], s["gid_index"], s["path_mtu"]) == ("^mlx5_1", 3, 1024)
    assert (s["traffic_class"], s["service_level"], s["dmabuf"]) == (106, 3, False)
    monkeypatch.setenv("MORI_IO_QP_MAX_SGE", "3")  # the MORI_IO_QP_MAX_SGE spelling wins
    assert rdma_testing.resolve_settings(RdmaBackendConfig())["max_sge"] == 3


@pytest.mark.parametrize(
    "config, fragment",
    [
        (dict(qp_per_transfer=0), "qp_per_transfer=0 must be in [1, 64]"),
        (dict(qp_per_transfer=65), "qp_per_transfer=65"),
        (dict(post_batch_size=0), "post_batch_size=0"),
        (dict(num_worker_threads=65), "num_worker_threads=65"),
        (dict(notif_per_qp=0), "notif_per_qp=0"),
        (dict(chunk_bytes=100), "chunk_bytes=100"),
        (dict(max_chunks_per_transfer=0), "max_chunks_per_transfer=0"),
        (dict(num_nics_per_transfer=2), "not implemented"),
        (dict(notif_per_qp=16384), "notif_per_qp + 16"),
    ],
)
def test_invalid_config_is_refused(rdma_testing: ModuleType, config: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        rdma_testing.resolve_settings(RdmaBackendConfig(**config))
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "var, value, fragment",
    [
        ("MORI_IO_QP_RNR_RETRY", "7", "retry forever"),
        ("MORI_IO_QP_TIMEOUT", "0", "wait forever"),
        ("MORI_IB_PATH_MTU", "1500", "one of 256"),
        ("MORI_IB_GID_INDEX", "300", "MORI_IB_GID_INDEX=300"),
        ("MORI_IO_POLL_CQ_MODE", "sometimes", "0/polling or 1/event"),
        ("MORI_IO_QP_PER_TRANSFER", "many", "not an integer"),
        ("MORI_IO_QP_MAX_SEND_WR", "8", "max_send_wr=8"),
        ("MORI_IO_SQ_BACKOFF_TIMEOUT_US", "5", "MORI_IO_SQ_BACKOFF_TIMEOUT_US=5"),
    ],
)
def test_invalid_environment_is_refused(rdma_testing: ModuleType, monkeypatch: pytest.MonkeyPatch, var: str,
                                        value: str, fragment: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as e:
        rdma_testing.resolve_settings(RdmaBackendConfig())
    assert fragment in str(e.value)


# ------------------------------------------------------------ error texts
IBV_WC = {"LOC_LEN": 1, "LOC_PROT": 4, "WR_FLUSH": 5, "REM_ACCESS": 10, "RETRY_EXC": 12, "RNR_RETRY_EXC": 13}


@pytest.mark.parametrize(
    "status, knobs",
    [
        (IBV_WC["RETRY_EXC"], ["MORI_IO_QP_TIMEOUT", "MORI_IO_QP_RETRY_CNT", "MORI_IB_GID_INDEX"]),
        (IBV_WC["RNR_RETRY_EXC"], ["notif_per_qp", "MORI_IO_QP_RNR_RETRY"]),
        (IBV_WC["REM_ACCESS"], ["deregistered"]),
        (IBV_WC["WR_FLUSH"], ["rebuilt on the next transfer"]),
        (IBV_WC["LOC_PROT"], ["memory region"]),
    ],
)
def test_completion_errors_name_cause_and_knob(rdma_testing: ModuleType, status: int, knobs: list[str]) -> None:
    text = rdma_testing.describe_completion_error(status, 0x81, is_read=False)
    assert text.startswith("RDMA write failed: ")
    assert f"ibv_wc_status {status}" in text and "vendor error 0x81" in text
    for k in knobs:
        assert k in text
    assert rdma_testing.describe_completion_error(status, 0, is_read=True).startswith("RDMA read failed")
    assert rdma_testing.describe_completion_error(status, 0, is_notification=True).startswith("notification send")


def test_send_queue_full_text(rdma_testing: ModuleType) -> None:
    text = rdma_testing.describe_send_queue_full(128, 16, 5000000)
    for k in ("5000000 us", "depth 128", "max_send_wr", "MORI_IO_QP_MAX_SEND_WR", "post_batch_size",
              "MORI_IO_SQ_BACKOFF_TIMEOUT_US"):
        assert k in text


# ------------------------------------------------------------ SQ credits


def test_credits_are_taken_and_returned(rdma_testing: ModuleType) -> None:
    c = rdma_testing.SqCredits(8)
    assert c.acquire(5, 1000) == "ok" and c.available() == 3
    assert c.acquire(9, 1000) == "too_large"
    t0 = time.monotonic()
    assert c.acquire(4, 50_000) == "timed_out"  # only 3 free: bounded wait
    assert 0.04 <= time.monotonic() - t0 < 2
    c.release(5)
    assert c.available() == 8
    c.release(100)  # never above the depth
    assert c.available() == 8


def test_a_waiter_gets_slots_when_a_completion_returns_them(rdma_testing: ModuleType) -> None:
    c = rdma_testing.SqCredits(4)
    assert c.acquire(4, 1000) == "ok"
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(c.acquire(2, 5_000_000)))
    t.start()
    time.sleep(0.05)
    c.release(2)
    t.join(5)
    assert result == ["ok"]


def test_abort_wakes_waiters_at_once(rdma_testing: ModuleType) -> None:
    c = rdma_testing.SqCredits(2)
    assert c.acquire(2, 1000) == "ok"
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(c.acquire(1, 60_000_000)))
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    c.abort()
    t.join(5)
    assert result == ["aborted"] and time.monotonic() - t0 < 1
    assert c.acquire(1, 1000) == "aborted"
