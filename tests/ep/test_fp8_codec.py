"""The combine kernels' FP8 e4m3 codec (ops/fp8_codec.hpp) equals torch's float8_e4m3fn cast.

The header is compiled for the host with the system C++ compiler and fed every bf16 value,
random float32 values over the whole e4m3 range (normal, subnormal, saturating) and the
special values; its bytes must equal ``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` and its
decoding of all 256 bytes must equal torch's. Skips without a C++ compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _cxx() -> str | None:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _inputs() -> torch.Tensor:
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(3)
    wide = (torch.rand(200_000, generator=g) * 2 - 1) * 520.0
    tiny = (torch.rand(200_000, generator=g) * 2 - 1) * 2.0**-5  # subnormal range and around 2^-6
    # exact ties between neighbours (round half to even) in the normal and subnormal ranges
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].sort().values
    ties = (codes[1:] + codes[:-1]) / 2
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 456.0, 464.0, 1e30, -1e30, float("inf"), -float("inf"),
                            float("nan"), 2.0**-6, 2.0**-9, 2.0**-10, 2.0**-10 * 1.0001, 2.0**-10 * 0.9999])
    return torch.cat([every_bf16, wide, tiny, ties, special]).to(torch.float32).contiguous()


def test_codec_matches_torch(tmp_path: Path) -> None:
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "fp8_codec_check"
    res = subprocess.run(
        [cxx, "-std=c++17", "-O2", f"-I{REPO / 'mori_core' / 'csrc'}", str(Path(__file__).parent / "fp8_codec_check.cpp"),
         "-o", str(exe)],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    xs = _inputs()
    (tmp_path / "in.f32").write_bytes(xs.numpy().tobytes())
    run = subprocess.run([str(exe), str(tmp_path / "in.f32"), str(tmp_path / "out.u8"), str(tmp_path / "dec.f32")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = torch.frombuffer(bytearray((tmp_path / "out.u8").read_bytes()), dtype=torch.uint8)
    want = xs.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    nan = torch.isnan(xs)
    # NaN: any e4m3 NaN code with the input's sign (torch writes 0x7f/0xff as well)
    assert torch.equal(got[nan] & 0x7F, torch.full_like(got[nan], 0x7F))
    bad = torch.nonzero(got[~nan] != want[~nan]).flatten()
    if bad.numel():
        i = int(bad[0])
        x = xs[~nan][i].item()
        raise AssertionError(f"{bad.numel()} encodings differ; first: x={x!r} ours=0x{int(got[~nan][i]):02x} "
                             f"torch=0x{int(want[~nan][i]):02x}")
    dec = torch.frombuffer(bytearray((tmp_path / "dec.f32").read_bytes()), dtype=torch.float32)
    ref = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(ref)
    assert torch.equal(dec[finite].view(torch.int32), ref[finite].view(torch.int32))
    assert torch.isnan(dec[~finite]).all()
