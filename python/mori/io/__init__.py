"""Alias of :mod:`mori_core.io` under MORI's name."""

from mori_core.io import *  # noqa: F401,F403
from mori_core.io import __all__  # noqa: F401
