"""CPU-side API tests of mori_core.ops / mori_core.shmem (run in CI, no GPU needed)."""

from __future__ import annotations

import pytest
import torch

import mori_core
from ep_dist_utils import single_rank_config
from mori_core.ops import (
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineOp,
    EpDispatchCombineQuantType,
    ReferenceEpDispatchCombineOp,
    gpu_ops_available,
)
from mori_core.ops.launch_config import LaunchParams, resolve


def test_mori_alias_exposes_the_same_api() -> None:
    import mori.cpp
    import mori.kernel_profiler
    import mori.ops
    import mori.shmem
    from mori_core.ops.profiler import export_to_perfetto

    assert mori.kernel_profiler.export_to_perfetto is export_to_perfetto
    # MORI defines get_debug_time_buf only in profiler builds (callers test with hasattr)
    assert hasattr(mori.cpp, "get_debug_time_buf") == bool(mori_core.build_info().get("profiler"))

    assert mori.ops.EpDispatchCombineOp is EpDispatchCombineOp
    assert mori.ops.EpDispatchCombineConfig is EpDispatchCombineConfig
    assert mori.shmem.MORI_SHMEM_INIT_WITH_UNIQUEID == 1
    assert callable(mori.shmem.shmem_torch_process_group_init)


def test_config_defaults_match_mori() -> None:
    cfg = single_rank_config()
    assert (cfg.warp_num_per_block, cfg.block_num, cfg.max_total_recv_tokens) == (8, 80, 0)
    assert cfg.use_external_inp_buf is True and cfg.kernel_type == EpDispatchCombineKernelType.IntraNode
    assert (cfg.gpu_per_node, cfg.rdma_block_num, cfg.num_qp_per_pe, cfg.quant_type) == (8, 0, 1, "none")
    assert [k.name for k in EpDispatchCombineKernelType] == [
        "IntraNode", "InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL", "IntraNodeLL"
    ]
    assert EpDispatchCombineQuantType.None_ == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_gpu_op_without_gpu_raises_a_clear_error() -> None:
    ok, why = gpu_ops_available()
    assert not ok and why
    with pytest.raises(RuntimeError, match="GPU"):
        EpDispatchCombineOp(single_rank_config())


def test_unimplemented_quant_types_say_so() -> None:
    with pytest.raises(NotImplementedError, match="quant_type"):
        EpDispatchCombineOp(single_rank_config(quant_type="fp4_blockwise"))
    # the reference accepts any kernel type: the semantics are the same
    ReferenceEpDispatchCombineOp(single_rank_config(kernel_type=EpDispatchCombineKernelType.InterNodeV1, gpu_per_node=1))


def test_launch_config_resolution_order(monkeypatch: pytest.MonkeyPatch) -> None:
    args = dict(config_block_num=80, config_warp_per_block=8, sm_count=132, arch_major=9, world_size=4)
    assert resolve("dispatch", 4096, -1, -1, mode="MANUAL", **args) == LaunchParams(80, 8)
    auto = resolve("dispatch", 4096, -1, -1, mode="AUTO", **args)
    assert auto != LaunchParams(80, 8)
    assert resolve("dispatch", 4096, 17, -1, mode="AUTO", **args).block_num == 17  # explicit wins
    assert resolve("combine_pull", 128, -1, 5, mode="MANUAL", **args) == LaunchParams(80, 5)
    monkeypatch.setenv("MORI_EP_LAUNCH_CONFIG_MODE", "sometimes")
    with pytest.raises(ValueError, match="MORI_EP_LAUNCH_CONFIG_MODE"):
        resolve("dispatch", 1, -1, -1, **args)


def test_shmem_api_before_init_and_bad_arguments() -> None:
    import mori_core.shmem as shmem

    with pytest.raises(RuntimeError, match="not initialised"):
        shmem.shmem_mype()
    with pytest.raises(RuntimeError, match="not initialised"):
        shmem.shmem_malloc(16)
    shmem.shmem_finalize()  # no-op when not initialised
    with pytest.raises(NotImplementedError):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_MPI_COMM, 0, 1, b"")
    with pytest.raises(ValueError, match="rank"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 3, 2, b"")
    with pytest.raises(ValueError, match="unique id"):
        from mori_core.shmem.bootstrap import parse_unique_id

        parse_unique_id(b"x" * 128)
    with pytest.raises(ValueError, match="not registered"):
        shmem.shmem_torch_process_group_init("no-such-group")


def test_unique_id_roundtrip() -> None:
    from mori_core.shmem.bootstrap import UNIQUE_ID_BYTES, parse_unique_id

    import mori_core.shmem as shmem

    uid = shmem.shmem_get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == UNIQUE_ID_BYTES
    parsed = parse_unique_id(uid)
    assert parsed.host == "127.0.0.1" and parsed.port > 0 and len(parsed.nonce) == 16
    assert parse_unique_id(torch.tensor(list(uid), dtype=torch.uint8)) == parsed


def test_heap_size_strings_parse() -> None:
    info = mori_core.build_info()
    if not info["shmem"]:
        pytest.skip("CPU-only build has no shmem bindings")
    from mori_core import _C

    assert _C.parse_size("6G") == 6 << 30 and _C.parse_size("512M") == 512 << 20
    with pytest.raises(ValueError, match="size"):
        _C.parse_size("lots")
