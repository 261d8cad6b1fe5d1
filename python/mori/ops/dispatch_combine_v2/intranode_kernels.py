"""Capability marker under the name of MORI's EPv2 kernel module.

SGLang probes ``mori.ops.dispatch_combine_v2.intranode_kernels._direct_cast_fp8_max`` to learn
whether an ``fp8_direct_cast`` combine saturates values past the fp8 maximum (older MORI builds
produced NaN there, and SGLang then switches to ``fp8_blockwise``). mori_core's direct cast
saturates to +-448 (float8_e4m3fn; ``mori_core.ops.combine_quant``), so the marker is present.
No kernels live here.
"""

from mori_core.ops.combine_quant import FP8_MAX as _direct_cast_fp8_max  # noqa: F401
