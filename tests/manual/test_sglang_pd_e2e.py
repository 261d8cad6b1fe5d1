"""Manual end-to-end check of SGLang PD disaggregation on mori-suite (seed 003's launch commands).

Runs only with ``SGLANG_MORI_MANUAL_E2E=1`` on a machine with >= 2 CUDA GPUs and
``sglang==0.5.23``, ``sglang-router`` and mori-suite installed. It writes a tiny
random-weight Llama (nothing is downloaded), starts a prefill server on GPU 0, a
decode server on GPU 1, both with ``--disaggregation-transfer-backend mori``, and
``sglang_router --pd-disaggregation --mini-lb``, then asks the router for a
generation and checks both servers logged mori-suite's manager.

Ports are configured, not discovered: ``SGLANG_MORI_E2E_BASE_PORT`` (default
31000) + 0 router, +1 prefill, +2 decode, +3 bootstrap. RDMA NICs, if any:
``SGLANG_MORI_E2E_IB_DEVICE`` (passed as ``--disaggregation-ib-device``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import List

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("SGLANG_MORI_MANUAL_E2E") != "1", reason="manual GPU test: set SGLANG_MORI_MANUAL_E2E=1"
)

STARTUP_TIMEOUT_S = 600


def _tiny_llama(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited early:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"{url} not healthy within {STARTUP_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")


def _launch(args: List[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def test_pd_generation_through_router(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    pytest.importorskip("sglang_router")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs >= 2 CUDA GPUs")
    model = _tiny_llama(tmp_path / "tiny-llama")
    base = int(os.environ.get("SGLANG_MORI_E2E_BASE_PORT", "31000"))
    lb, prefill, decode, bootstrap = base, base + 1, base + 2, base + 3
    common = ["--model-path", str(model), "--host", "127.0.0.1", "--tp-size", "1", "--skip-tokenizer-init",
              "--disaggregation-transfer-backend", "mori", "--disable-radix-cache", "--mem-fraction-static", "0.3"]
    ib = os.environ.get("SGLANG_MORI_E2E_IB_DEVICE")
    if ib:
        common += ["--disaggregation-ib-device", ib]
    env = dict(os.environ)
    procs = []
    try:
        procs.append(_launch(["sglang.launch_server", *common, "--disaggregation-mode", "prefill", "--port", str(prefill),
                              "--disaggregation-bootstrap-port", str(bootstrap), "--base-gpu-id", "0"],
                             tmp_path / "prefill.log", env))
        procs.append(_launch(["sglang.launch_server", *common, "--disaggregation-mode", "decode", "--port", str(decode),
                              "--base-gpu-id", "1"], tmp_path / "decode.log", env))
        _wait_http(f"http://127.0.0.1:{prefill}/health", procs[0], tmp_path / "prefill.log")
        _wait_http(f"http://127.0.0.1:{decode}/health", procs[1], tmp_path / "decode.log")
        procs.append(_launch(["sglang_router.launch_router", "--pd-disaggregation", "--mini-lb",
                              "--prefill", f"http://127.0.0.1:{prefill}", str(bootstrap),
                              "--decode", f"http://127.0.0.1:{decode}",
                              "--host", "127.0.0.1", "--port", str(lb)], tmp_path / "router.log", env))
        _wait_http(f"http://127.0.0.1:{lb}/health", procs[2], tmp_path / "router.log")
        body = json.dumps({"input_ids": [1, 15, 27, 99, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
        req = urllib.request.Request(f"http://127.0.0.1:{lb}/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            out = json.loads(r.read())
        assert len(out["output_ids"]) == 8, out
        for role in ("prefill", "decode"):
            assert "implementation=mori-suite" in (tmp_path / f"{role}.log").read_text(), f"{role} did not use mori-suite"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
