"""configs/vllm_omni/*.yaml through vLLM-Omni 0.30's own loaders, and a three-stage
chain built from what those loaders hand each stage.

The YAMLs are parsed unchanged (deploy loader, pipeline merge, transfer-config
loader, per-stage connector config, spec resolution). The chain test only
swaps host, base port and pool size so it runs on any CPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mori_integrations.vllm_omni.settings import ConnectorSettings, detect_local_ip

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "vllm_omni"
YAMLS = {
    "qwen2_5_omni_mori.yaml": ("qwen2_5_omni", "QWEN2_5_OMNI_PIPELINE", False),
    "qwen3_omni_moe_mori_intranode.yaml": ("qwen3_omni", "QWEN3_OMNI_PIPELINE", True),
}


def stage_spec(transfer_cfg, stage_id: int) -> dict:
    """The connector spec vLLM-Omni 0.30 gives a stage (stage_init_utils.get_stage_connector_spec:
    for transfer-engine connectors, the first entry of get_stage_connector_config; that module
    itself imports diffusers, which the CI environment leaves out)."""
    from vllm_omni.distributed.omni_connectors.utils.initialization import get_stage_connector_config

    entries = get_stage_connector_config(transfer_cfg, stage_id)
    return dict(next(iter(entries.values()))["spec"])


def resolved_extra(transfer_cfg, stage_id: int, local_rank: int = 0) -> dict:
    """The ``extra`` a stage's connector is built from (chunk adapter / model runner path)."""
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
    from vllm_omni.distributed.omni_connectors.utils.initialization import resolve_connector_spec

    spec = stage_spec(transfer_cfg, stage_id)
    role = spec["extra"].get("role")
    resolved = resolve_connector_spec(ConnectorSpec(name=spec["name"], extra=spec["extra"]), stage_id=stage_id,
                                      role=role, local_rank=local_rank, replica_id=0)
    assert resolved.name == "MoriTransferEngineConnector"
    return resolved.extra


@pytest.mark.parametrize("yaml_name", sorted(YAMLS))
def test_vllm_omni_loaders_parse_the_yaml_unchanged(yaml_name: str) -> None:
    import importlib

    from vllm_omni.config.stage_config import load_deploy_config, merge_pipeline_deploy, resolve_deploy_yaml
    from vllm_omni.distributed.omni_connectors.utils.initialization import load_omni_transfer_config

    module, pipeline_name, async_chunk = YAMLS[yaml_name]
    path = CONFIGS / yaml_name
    deploy = load_deploy_config(path)
    assert deploy.async_chunk is async_chunk and [s.stage_id for s in deploy.stages] == [0, 1, 2]
    pipeline = getattr(importlib.import_module(f"vllm_omni.model_executor.models.{module}.pipeline"), pipeline_name)
    stages = merge_pipeline_deploy(pipeline, deploy)  # validates async_chunk against the pipeline
    assert [s.stage_id for s in stages] == [0, 1, 2]

    cfg = load_omni_transfer_config(config_dict=resolve_deploy_yaml(path))
    assert set(cfg.connectors) == {("0", "1"), ("1", "2")}
    assert {spec.name for spec in cfg.connectors.values()} == {"MoriTransferEngineConnector"}

    for rank in (0, 1):  # vLLM-Omni's per-TP-rank stride, followed by every stage
        extras = [resolved_extra(cfg, sid, local_rank=rank) for sid in range(3)]
        s0, s1, s2 = (ConnectorSettings.from_extra(e) for e in extras)
        base = 50051 + 16 * rank
        assert (s0.role, s1.role, s2.role) == ("sender", "receiver", "receiver")
        assert s0.listen_port == base and s1.sender_zmq_port == base
        # The talker receives 0->1 and serves 1->2 on the port the code2wav stage asks for.
        assert s1.listen_port == s2.sender_zmq_port == base + 1
        assert s0.host == s2.sender_host == detect_local_ip()
        if async_chunk:
            assert s0.memory_pool_device == "cuda" and s0.backend_type == "auto"


def test_three_stage_chain_built_from_the_qwen2_5_yaml(omni_procs, free_base_port) -> None:
    from vllm_omni.config.stage_config import resolve_deploy_yaml
    from vllm_omni.distributed.omni_connectors.utils.initialization import load_omni_transfer_config

    raw = resolve_deploy_yaml(CONFIGS / "qwen2_5_omni_mori.yaml")
    base = free_base_port(4)
    raw["connectors"]["mori_connector"]["extra"].update(host="127.0.0.1", zmq_port=base, memory_pool_size="32M")
    cfg = load_omni_transfer_config(config_dict=raw)
    thinker, talker, code2wav = omni_procs
    for sid, proc in enumerate(omni_procs):
        proc.call("create", cid=f"chain{sid}", extra=resolved_extra(cfg, sid))
    assert talker.call("health", cid="chain1")["zmq_port"] == base + 1

    # Request 1, orchestrator style: each put's metadata travels with the request.
    hidden = thinker.call("put", cid="chain0", frm="0", to="1", key="req-1", kind="object", nbytes=1_611_713, seed=1)
    assert hidden["ok"] and hidden["size"] > 1_600_000
    relay = talker.call("relay", cid="chain1", frm="0", to="1", key="req-1", md=hidden["md"], out_to="2",
                        out_kind="object", out_nbytes=3305, seed=2)
    assert relay["got"]["found"] and relay["got"]["digest"] == hidden["digest"]
    assert relay["put"]["ok"] and relay["put"]["md"]["source_port"] == base + 1
    codes = code2wav.call("get", cid="chain2", frm="1", to="2", key="req-1", md=relay["put"]["md"])
    assert codes["found"] and codes["digest"] == relay["put"]["digest"]

    # Request 2, no metadata at all: every stage finds its upstream from the YAML wiring alone.
    hidden = thinker.call("put", cid="chain0", frm="0", to="1", key="req-2", kind="tensor", nbytes=1_611_712, seed=3)
    relay = talker.call("relay", cid="chain1", frm="0", to="1", key="req-2", md=None, out_to="2",
                        out_kind="tensor", out_nbytes=3304, seed=4)
    assert relay["got"]["found"] and relay["got"]["digest"] == hidden["digest"]
    codes = code2wav.call("get", cid="chain2", frm="1", to="2", key="req-2", md=None)
    assert codes["found"] and codes["digest"] == relay["put"]["digest"]

    for sid, proc in enumerate(omni_procs):
        assert proc.call("health", cid=f"chain{sid}")["pool_used_bytes"] == 0
        proc.call("close", cid=f"chain{sid}")
