"""``--moe-a2a-backend mori`` on NVIDIA: what stock SGLang's MORI dispatcher needs besides ``mori``.

SGLang 0.5.23's ``sglang/srt/layers/moe/token_dispatcher/moriep.py`` runs unchanged on
mori-suite's ``mori`` alias (EPv1: ``mori.ops``; EPv2, the default: ``mori.ops.dispatch_combine_v2``
and ``mori.cco``). Two things in it are ROCm-only, and :func:`install` provides them as the
module globals that file reads:

* ``get_hip_quant`` / ``QuantType`` (imported from aiter only on ROCm): the FP8 per-1x128 and
  MX per-1x32 dispatch quantisers, from :mod:`.moe_quant`. Without them the EPv1 dispatcher
  fails with a NameError on construction.
* ``_use_aiter`` (``SGLANG_USE_AITER and is_hip()``): gates only two things in moriep.py -- the
  EPv2 dispatcher binds the quantisers, and the dispatcher builds its local-expert mask. Both are
  wanted on NVIDIA, so it is set True there.

On ROCm nothing is touched: SGLang keeps aiter. Nothing else of SGLang is patched.
"""

from __future__ import annotations

import importlib
import logging

import torch

from mori_integrations.sglang import moe_quant

logger = logging.getLogger(__name__)

MORIEP_MODULE = "sglang.srt.layers.moe.token_dispatcher.moriep"


def install() -> str:
    """Provide moriep.py's ROCm-only globals on a non-ROCm torch; returns what was done (for the log)."""
    if getattr(torch.version, "hip", None):
        return "ROCm torch: SGLang's MORI dispatcher keeps aiter"
    moriep = importlib.import_module(MORIEP_MODULE)
    current = getattr(moriep, "get_hip_quant", None)
    if current is not None and current is not moe_quant.get_hip_quant:
        return f"{MORIEP_MODULE} already has get_hip_quant from {getattr(current, '__module__', '?')}; left alone"
    moriep.QuantType = moe_quant.QuantType
    moriep.get_hip_quant = moe_quant.get_hip_quant
    moriep._use_aiter = True
    return "MORI MoE dispatcher: FP8/MX dispatch quantisation from mori_integrations.sglang.moe_quant"


def is_installed() -> bool:
    """True when moriep.py's quantiser global is mori-suite's."""
    moriep = importlib.import_module(MORIEP_MODULE)
    return getattr(moriep, "get_hip_quant", None) is moe_quant.get_hip_quant
