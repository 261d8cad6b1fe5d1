"""Alias of :mod:`mori_core.ops` (MORI-EP) under MORI's name."""

from mori_core.ops import *  # noqa: F401,F403
