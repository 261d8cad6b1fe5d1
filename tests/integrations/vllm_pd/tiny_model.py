"""A tiny random-weight Llama the PD tests write themselves (nothing is downloaded).

hidden 128, 2 KV heads of 64 (vLLM's CPU attention refuses head size 16), 2 layers,
vocabulary 512, float32. The weights are drawn with a larger spread than a trained
model's initialisation so that greedy decoding gives varied tokens whose top-1 margin
dwarfs float rounding: a wrong KV byte changes the output, batching noise does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

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
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_llama(path: Path, seed: int = 0, std: float = 0.15) -> Path:
    """Write config.json + model.safetensors of the tiny Llama into ``path``."""
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
    (path / "config.json").write_text(json.dumps(CONFIG, indent=1))
    return path


def kv_bytes_per_token() -> int:
    """KV cache bytes of one token over all layers (K and V, float32)."""
    return CONFIG["num_hidden_layers"] * 2 * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 4
