"""Alias of :mod:`mori_core.ccl` (MORI-CCL) under MORI's name."""

from mori_core.ccl import *  # noqa: F401,F403
from mori_core.ccl import __getattr__  # noqa: F401 - names upstream has and mori-suite does not
