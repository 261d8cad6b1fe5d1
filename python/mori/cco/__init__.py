"""Alias of :mod:`mori_core.cco` (MORI's CCO communicator API) under MORI's name."""

from mori_core.cco import *  # noqa: F401,F403
from mori_core.cco import __all__  # noqa: F401
