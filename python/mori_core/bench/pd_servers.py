"""vLLM servers (and the PD proxy) as subprocesses, and a tiny model to serve, for the PD benchmark and tests.

* :func:`write_tiny_llama` -- a tiny random-weight Llama written locally (nothing is downloaded):
  hidden 128, 2 KV heads of 64 (vLLM's CPU attention refuses head size 16), 2 layers,
  vocabulary 512, float32. The weights are drawn with a larger spread than a trained
  model's initialisation so that greedy decoding gives varied tokens whose top-1 margin
  dwarfs float rounding: a wrong KV byte changes the output, batching noise does not.
* :class:`Managed` -- a subprocess in its own session (process group), so :meth:`Managed.stop`
  ends the API server, engine core and workers together, also after a failed start.
  Every wait is bounded; a server that exits early fails its start with its log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_llama(path: Path, seed: int = 0, std: float = 0.15, sliding_window: int = 0) -> Path:
    """Write config.json + model.safetensors of the tiny Llama into ``path``.

    With ``sliding_window`` > 0 the second layer attends only to the last ``sliding_window``
    tokens (``layer_types``), so vLLM's hybrid KV cache manager keeps two KV cache groups.
    """
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, f, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h), "lm_head.weight": w(v, h)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(f, h),
            p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        })
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(CONFIG)
    if sliding_window:
        config.update(sliding_window=sliding_window, layer_types=["full_attention", "sliding_attention"])
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def kv_bytes_per_token() -> int:
    """KV cache bytes of one token over all layers (K and V, float32)."""
    return CONFIG["num_hidden_layers"] * 2 * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 4


# vLLM's CPU defaults pin every server's worker to the same core; PD puts two servers on one
# host, so let the OS place threads (and keep OpenMP from spinning on a shared core).
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "TORCHVISION_WARN_WHEN_EXTENSION_LOADING_FAILS": "",
    "PYTHONWARNINGS": "ignore",
}


class Managed:
    """A subprocess in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.argv, self.env, self.log_dir = list(argv), dict(env or {}), log_dir
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            list(argv), stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, not a shutdown)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def respawn(self, name: str) -> "Managed":
        """The same command started again (same ports) as ``name``; this one must have ended."""
        if self.alive():
            raise RuntimeError(f"{self.name} is still running; kill or stop it before starting it again")
        self._log.close()
        return Managed(name, self.argv, self.log_dir, self.env)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group (workers)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        self._log.close()


def http_get(url: str, timeout: float = 5.0) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def http_post(url: str, body: Dict[str, Any], timeout: float = 120.0) -> Tuple[int, Dict[str, Any] | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_healthy(servers: Sequence["Managed"], urls: Sequence[str], timeout: float) -> None:
    """Wait until every ``url/health`` answers 200; raise with the log of a server that died or hung."""
    deadline = time.monotonic() + timeout
    pending = dict(zip(urls, servers))
    while pending:
        for url, srv in list(pending.items()):
            if not srv.alive():
                raise RuntimeError(f"{srv.name} exited during start-up:\n{srv.log_tail()}")
            try:
                if http_get(url + "/health", timeout=2)[0] == 200:
                    del pending[url]
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(s.name for s in pending.values())
            raise RuntimeError(f"not healthy within {timeout:.0f} s: {names}\n{next(iter(pending.values())).log_tail()}")
        time.sleep(1.0)


def vllm_argv(model: Path, port: int, kv_config: Optional[Dict[str, Any]], max_model_len: int = 1024) -> List[str]:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--skip-tokenizer-init", "--max-model-len", str(max_model_len), "--enforce-eager",
        "--dtype", "float32", "--block-size", "32", "--max-num-seqs", "8",
        "--max-num-batched-tokens", str(max(1024, max_model_len)),
        "--seed", "0", "--served-model-name", "tiny",
    ]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    return argv


def metrics(url: str) -> Dict[str, float]:
    """``/metrics`` as {"name{labels}": value} (only samples, comments dropped)."""
    status, text = http_get(url + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def metric(sample: Dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in sample.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def complete(url: str, prompt: Sequence[int], max_tokens: int, kv_params: Optional[Dict[str, Any]] = None,
             timeout: float = 120.0) -> Tuple[int, Any]:
    """A greedy completion; returns (HTTP status, response JSON or error text)."""
    body: Dict[str, Any] = {"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    return http_post(url + "/v1/completions", body, timeout)
