"""Alias of :mod:`mori_core.ops.dispatch_combine_v2` (MORI's EPv2 API) under MORI's name."""

from mori_core.ops.dispatch_combine_v2 import *  # noqa: F401,F403
from mori_core.ops.dispatch_combine_v2 import __all__  # noqa: F401
