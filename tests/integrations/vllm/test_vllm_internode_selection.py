"""The vLLM adapter picks MORI's kernel family from the EP group's node layout (CPU, no GPU)."""

from __future__ import annotations

import pytest
import torch

from mori_integrations.vllm.mori_utils import (
    ENV_INTERNODE_KERNEL,
    LaunchSettings,
    MoriEpConfig,
    select_ep_topology,
)


def test_one_node_is_intranode_and_several_nodes_are_internode_v1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_INTERNODE_KERNEL, raising=False)
    assert select_ep_topology(8, 8).kernel_type == "IntraNode"
    t = select_ep_topology(16, 8)
    assert (t.kernel_type, t.gpu_per_node) == ("InterNodeV1", 8)
    assert select_ep_topology(2, 1).gpu_per_node == 1
    monkeypatch.setenv(ENV_INTERNODE_KERNEL, "InterNodeV1LL")
    assert select_ep_topology(32, 8).kernel_type == "InterNodeV1LL"
    assert select_ep_topology(4, 4).kernel_type == "IntraNode"  # one node ignores the inter-node choice


def test_bad_layouts_and_kernel_names_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        select_ep_topology(12, 6)
    with pytest.raises(ValueError, match="ranks_on_first_node"):
        select_ep_topology(8, 0)
    monkeypatch.setenv(ENV_INTERNODE_KERNEL, "IntraNode")
    with pytest.raises(ValueError, match=ENV_INTERNODE_KERNEL):
        select_ep_topology(16, 8)


def test_internode_layer_config_becomes_an_internode_op_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from mori_core.ops import EpDispatchCombineKernelType

    monkeypatch.delenv(ENV_INTERNODE_KERNEL, raising=False)
    topo = select_ep_topology(16, 8)
    layer = MoriEpConfig(
        rank=3, world_size=16, hidden_dim=256, dispatch_dtype=torch.bfloat16, activation_dtype=torch.bfloat16,
        scale_dim=0, max_num_tokens_per_rank=64, num_local_experts=16, num_experts_per_token=8,
        kernel_type=topo.kernel_type, gpu_per_node=topo.gpu_per_node,
    )
    cfg = layer.to_op_config(LaunchSettings(block_num=132, warp_num_per_block=16))
    cfg.validate()
    assert cfg.kernel_type == EpDispatchCombineKernelType.InterNodeV1 and cfg.gpu_per_node == 8
    assert (cfg.block_num, cfg.rdma_block_num, cfg.warp_num_per_block) == (96, 64, 8)
    intra = MoriEpConfig(**{**layer.__dict__, "world_size": 8, "rank": 3, "kernel_type": "IntraNode",
                            "gpu_per_node": 0}).to_op_config(LaunchSettings(132, 16))
    assert intra.kernel_type == EpDispatchCombineKernelType.IntraNode and intra.block_num == 132
    # layers with the same shape but another topology are different cache keys
    assert layer != MoriEpConfig(**{**layer.__dict__, "kernel_type": "InterNodeV1LL"})
