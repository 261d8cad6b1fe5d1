"""Single-process checks of the vLLM adapter: what is refused (and how), config and env parsing,
FP8 row quantisation."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mori_integrations.vllm import quant  # noqa: E402
from mori_integrations.vllm.dispatch_quant import QuantStage, plan_dispatch_quant  # noqa: E402
from mori_integrations.vllm.mori_utils import (  # noqa: E402
    ENV_BLOCK_NUM,
    ENV_FP8_DISPATCH,
    MoriEpConfig,
    launch_settings_for,
    use_fp8_dispatch_from_env,
)

FP8 = torch.float8_e4m3fn
H = 256


def _fp8_config(**kw):  # noqa: ANN003, ANN202 - vLLM's own factory keywords
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    ones = torch.ones(4)
    return fp8_w8a8_moe_quant_config(ones, ones, **kw)


# --------------------------------------------------------------------------- quant plans
def test_supported_activation_schemes_map_to_dispatch_stages() -> None:
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    assert plan_dispatch_quant(None, H, FP8).stage is QuantStage.NONE
    assert plan_dispatch_quant(FUSED_MOE_UNQUANTIZED_CONFIG, H, FP8).stage is QuantStage.NONE
    p = plan_dispatch_quant(_fp8_config(per_act_token_quant=True), H, FP8)
    assert (p.stage, p.scale_dim, p.dispatch_dtype) == (QuantStage.BEFORE_DISPATCH, 1, FP8)
    p = plan_dispatch_quant(_fp8_config(block_shape=[128, 128]), H, FP8)
    assert (p.stage, p.scale_dim) == (QuantStage.BEFORE_DISPATCH, H // 128)
    p = plan_dispatch_quant(_fp8_config(a1_scale=torch.tensor([0.1])), H, FP8)
    assert (p.stage, p.scale_dim) == (QuantStage.STATIC_TENSOR, 0)
    assert plan_dispatch_quant(_fp8_config(), H, FP8).stage is QuantStage.AFTER_DISPATCH


@pytest.mark.parametrize("qdtype", [torch.int8, "nvfp4", "mxfp4", "mxfp8"])
def test_unsupported_activation_quantisation_is_refused_by_name(qdtype: object) -> None:
    cfg = SimpleNamespace(quant_dtype=qdtype)
    with pytest.raises(ValueError) as e:
        plan_dispatch_quant(cfg, H, FP8)
    assert "mori_ep" in str(e.value) and repr(qdtype) in str(e.value) and "supported" in str(e.value)


def test_block_size_must_divide_hidden() -> None:
    with pytest.raises(ValueError, match="block size 128 .* must divide hidden_dim=200"):
        plan_dispatch_quant(_fp8_config(block_shape=[128, 128]), 200, FP8)


def test_static_scale_must_be_per_tensor() -> None:
    with pytest.raises(ValueError, match="one per-tensor value"):
        plan_dispatch_quant(_fp8_config(a1_scale=torch.tensor([0.1, 0.2])), H, FP8)


# --------------------------------------------------------------------------- experts
def _parallel_config_mori_ep():  # noqa: ANN202
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    base = FusedMoEParallelConfig.make_no_parallel()
    return dataclasses.replace(base, dp_size=2, ep_size=2, use_ep=True, all2all_backend="mori_ep")


def _bare(cls: type) -> object:
    """An experts instance without running its (device-specific) constructor."""
    obj = object.__new__(cls)
    obj.moe_config = SimpleNamespace(moe_parallel_config=_parallel_config_mori_ep())
    return obj


def test_cpu_experts_that_ignore_expert_map_are_refused() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from mori_integrations.vllm.prepare_finalize import check_experts_compatible

    with pytest.raises(ValueError, match="ignores expert_map"):
        check_experts_compatible(_bare(CPUUnquantizedExperts))


def test_experts_vllm_refuses_behind_deepep_ht_are_refused() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsFp8

    from mori_integrations.vllm.prepare_finalize import check_experts_compatible

    with pytest.raises(ValueError, match="DeepEP high-throughput"):
        check_experts_compatible(_bare(CutlassExpertsFp8))


def test_batched_experts_are_refused() -> None:
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts

    from mori_integrations.vllm.prepare_finalize import check_experts_compatible

    with pytest.raises(ValueError, match="Standard-format"):
        check_experts_compatible(_bare(BatchedTritonExperts))


def test_batched_layout_takes_batched_experts_only() -> None:
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts
    from vllm_ep_experts import TorchBatchedExperts, TorchExperts

    from mori_integrations.vllm.prepare_finalize import check_experts_compatible

    check_experts_compatible(_bare(BatchedTritonExperts), batched=True)
    check_experts_compatible(_bare(TorchBatchedExperts), batched=True)
    with pytest.raises(ValueError, match="takes Standard-format rows"):
        check_experts_compatible(_bare(TorchExperts), batched=True)


def test_batched_format_hook_only_for_mori_ep_with_the_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from mori_integrations.vllm import hooks
    from mori_integrations.vllm.mori_utils import ENV_BATCHED_EXPERTS

    hooks.install_batched_format_hook(hooks.resolve_targets())
    hooks.install_batched_format_hook(hooks.resolve_targets())  # idempotent
    mori = _parallel_config_mori_ep()
    other = dataclasses.replace(mori, all2all_backend="allgather_reducescatter")
    monkeypatch.delenv(ENV_BATCHED_EXPERTS, raising=False)
    assert not mori.use_batched_activation_format
    monkeypatch.setenv(ENV_BATCHED_EXPERTS, "1")
    assert mori.use_batched_activation_format and not other.use_batched_activation_format
    monkeypatch.setenv(ENV_BATCHED_EXPERTS, "maybe")
    with pytest.raises(ValueError, match=ENV_BATCHED_EXPERTS):
        mori.use_batched_activation_format  # noqa: B018 - the property raises


def test_standard_experts_honouring_expert_map_are_accepted() -> None:
    from vllm_ep_experts import TorchExperts, TorchExpertsReducedInFinalize

    from mori_integrations.vllm.prepare_finalize import check_experts_compatible

    check_experts_compatible(_bare(TorchExperts))
    check_experts_compatible(_bare(TorchExpertsReducedInFinalize))


# --------------------------------------------------------------------------- factory refusals
def _moe(**parallel: object) -> SimpleNamespace:
    return SimpleNamespace(moe_parallel_config=SimpleNamespace(enable_eplb=False, **parallel))


def test_factory_refuses_monolithic_experts_eplb_and_round_robin() -> None:
    from mori_integrations.vllm.factory import make_mori_prepare_finalize

    with pytest.raises(ValueError, match="monolithic"):
        make_mori_prepare_finalize(_moe(), None, use_monolithic=True)
    moe = _moe()
    moe.moe_parallel_config.enable_eplb = True
    with pytest.raises(ValueError, match="--enable-eplb"):
        make_mori_prepare_finalize(moe, None)
    tables = (torch.zeros(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="round-robin"):
        make_mori_prepare_finalize(_moe(), None, routing_tables=tables)


def test_factory_names_the_plugin_when_the_manager_is_not_ours() -> None:
    from mori_integrations.vllm.factory import make_mori_prepare_finalize

    with pytest.raises(RuntimeError, match="VLLM_PLUGINS"):
        make_mori_prepare_finalize(_moe(), None, all2all_manager=SimpleNamespace())


# --------------------------------------------------------------------------- config / env
def test_env_flags_are_parsed_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FP8_DISPATCH, raising=False)
    assert use_fp8_dispatch_from_env() is False
    monkeypatch.setenv(ENV_FP8_DISPATCH, "1")
    assert use_fp8_dispatch_from_env() is True
    monkeypatch.setenv(ENV_FP8_DISPATCH, "maybe")
    with pytest.raises(ValueError, match=ENV_FP8_DISPATCH):
        use_fp8_dispatch_from_env()
    monkeypatch.setenv(ENV_BLOCK_NUM, "0")
    with pytest.raises(ValueError, match=ENV_BLOCK_NUM):
        launch_settings_for(torch.device("cpu"))
    monkeypatch.setenv(ENV_BLOCK_NUM, "24")
    assert launch_settings_for(torch.device("cpu")).block_num == 24


def test_mori_ep_config_rejects_bad_fields() -> None:
    good = dict(
        rank=0,
        world_size=2,
        hidden_dim=H,
        dispatch_dtype=torch.bfloat16,
        activation_dtype=torch.bfloat16,
        scale_dim=0,
        max_num_tokens_per_rank=8,
        num_local_experts=2,
        num_experts_per_token=2,
    )
    assert MoriEpConfig(**good).max_token_type_size() == 2
    assert MoriEpConfig(**dict(good, activation_dtype=torch.float16)).combine_dtype == torch.float32
    with pytest.raises(ValueError, match="rank=2"):
        MoriEpConfig(**dict(good, rank=2))
    with pytest.raises(ValueError, match="scale_dim=3 must divide hidden_dim"):
        MoriEpConfig(**dict(good, scale_dim=3))
    with pytest.raises(ValueError, match="max_num_tokens_per_rank"):
        MoriEpConfig(**dict(good, max_num_tokens_per_rank=0))


# --------------------------------------------------------------------------- quantisation
@pytest.mark.parametrize("groups", [1, 2])
def test_fp8_rows_round_trip_within_fp8_precision(groups: int) -> None:
    x = torch.randn(17, H) * torch.logspace(-2, 2, 17).unsqueeze(1)
    q, s = quant.quantize_rows(x, groups)
    assert q.dtype == FP8 and s.shape == (17, groups)
    back = quant.dequantize_rows(q, s, torch.float32)
    err = (back - x).abs().view(17, groups, -1).amax(-1) / x.abs().view(17, groups, -1).amax(-1)
    assert float(err.max()) < 0.07  # e4m3: 3 mantissa bits
    zeros = quant.quantize_dequantize_rows(torch.zeros(3, H))
    assert torch.equal(zeros, torch.zeros(3, H))
    with pytest.raises(ValueError, match="groups=3"):
        quant.quantize_rows(x, 3)
