"""mori-suite's stand-ins for aiter's per-1x128 FP8 and per-1x32 MX quantisers (what SGLang's
MORI dispatcher calls), and how the plugin provides them to stock moriep.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mori_integrations.sglang.moe_quant import FP4_ENV_HINT, QuantType, get_hip_quant

FP8 = torch.float8_e4m3fn


def _x(n: int = 5, h: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, h, generator=g) * torch.logspace(-3, 2, h)
    x[1, 128:] = 0  # an all-zero block
    return x.to(torch.bfloat16)


def test_per_1x128_layout_and_values() -> None:
    x = _x()
    q, s = get_hip_quant(QuantType.per_1x128)(x, quant_dtype=FP8)
    assert q.dtype == FP8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (5, 2)
    blocks = x.float().view(5, 2, 128)
    # scale = block amax / 448 (1 for the zero block); the largest value hits the fp8 max
    amax = blocks.abs().amax(-1)
    torch.testing.assert_close(s, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    deq = q.float().view(5, 2, 128) * s.unsqueeze(-1)
    assert torch.all((deq - blocks).abs() <= blocks.abs() * 0.0625 + s.unsqueeze(-1) * 2**-9)
    assert torch.all(deq[1, 1] == 0)


def test_per_1x32_mxfp8_e8m0_scales() -> None:
    x = _x()
    q, s = get_hip_quant(QuantType.per_1x32)(x, quant_dtype=FP8, scale_type=torch.float8_e8m0fnu)
    assert q.dtype == FP8 and s.dtype == torch.float8_e8m0fnu and s.shape == (5, 256 // 32)
    scale = s.float()  # powers of two
    assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))
    blocks = x.float().view(5, 8, 32)
    amax = blocks.abs().amax(-1)
    # the smallest power of two that keeps every block within +-448 (no saturation)
    nz = amax > 0
    assert torch.all(amax[nz] / scale[nz] <= 448) and torch.all(amax[nz] / scale[nz] > 224)
    deq = q.float().view(5, 8, 32) * scale.unsqueeze(-1)
    assert torch.all((deq - blocks).abs() <= blocks.abs() * 0.0625 + scale.unsqueeze(-1) * 2**-9)
    _, s32 = get_hip_quant(QuantType.per_1x32)(x, quant_dtype=FP8)
    assert s32.dtype == torch.float32 and torch.equal(s32, scale)


def test_unsupported_requests_say_what_to_change() -> None:
    with pytest.raises(NotImplementedError, match="SGLANG_MORI_DISPATCH_DTYPE=fp8 or bf16"):
        get_hip_quant(QuantType.per_1x32)(_x(), shuffle=False)  # aiter's default: MXFP4
    assert "SGLANG_MORI_DISPATCH_DTYPE" in FP4_ENV_HINT
    with pytest.raises(ValueError, match="per_1x128 and per_1x32"):
        get_hip_quant(QuantType.per_Token)
    with pytest.raises(ValueError, match="multiple of the quantisation block 128"):
        get_hip_quant(QuantType.per_1x128)(torch.zeros(2, 100), quant_dtype=FP8)


PROBE = r"""
import sys
import sglang.srt.layers.moe.token_dispatcher.moriep as m
before = hasattr(m, "get_hip_quant")
if sys.argv[1] == "plugin":
    from sglang.srt.plugins import load_plugins
    load_plugins()
print("RESULT", before, getattr(m, "get_hip_quant", None).__module__ if hasattr(m, "get_hip_quant") else None,
      getattr(m, "QuantType", None).__name__ if hasattr(m, "QuantType") else None, m._use_aiter)
"""


@pytest.mark.parametrize("mode", ["plugin", "bare"])
def test_plugin_provides_moriep_globals(mode: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    if mode == "plugin":
        assert line == "RESULT False mori_integrations.sglang.moe_quant QuantType True", line
    else:  # control: stock SGLang on a non-ROCm torch has neither
        assert line == "RESULT False None None False", line
