"""The ``mori_suite_ep`` entry point makes a fresh vLLM accept ``mori_ep`` and use our classes.

Each test runs ``vllm_registration_probe.py`` in a fresh interpreter (plugins are
per-process state), with a tiny Mixtral config written by the test (no weights needed:
only configs are built).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240

TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_mixtral")
    (d / "config.json").write_text(json.dumps(TINY_MIXTRAL))
    return d


def _probe(mode: str, model_dir: Path, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_registration_probe.py"), mode, str(model_dir)],
        env=dict(os.environ, VLLM_TARGET_DEVICE="cpu", **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")]
    assert lines, f"probe printed no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1][len("PROBE_RESULT ") :])
    assert "exception" not in result, result["exception"]
    return result


def test_fresh_vllm_accepts_mori_ep_and_maps_it_to_our_classes(model_dir: Path) -> None:
    r = _probe("plugins", model_dir)
    assert "mori_suite_ep" in r["entry_points"]
    assert r["parallel_config_accepts"] is True
    assert r["unknown_still_rejected"] is True
    assert r["nested_dict_accepts"] == "mori_ep"
    assert r["cli_value"] == "mori_ep"
    assert r["engine_config_backend"] == "mori_ep"
    assert r["cudagraph_mode"].endswith("NONE")
    assert r["prepare_finalize_hooked"] and r["oracles_rebound"] and r["communicator_hooked"]
    assert r["single_wrap"] is True


def test_stock_vllm_without_the_plugin_refuses_mori_ep(model_dir: Path) -> None:
    r = _probe("no_plugin", model_dir, VLLM_PLUGINS="")
    assert str(r["parallel_config_accepts"]).startswith("rejected")


def test_missing_hook_point_fails_loudly_and_patches_nothing(model_dir: Path) -> None:
    r = _probe("broken", model_dir, VLLM_PLUGINS="")
    assert r["error"] and "maybe_make_prepare_finalize" in r["error"] and "mori_ep" in r["error"]
    assert str(r["parallel_config_accepts"]).startswith("rejected")
