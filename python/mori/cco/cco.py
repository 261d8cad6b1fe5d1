"""Alias of :mod:`mori_core.cco.cco` under MORI's name."""

from mori_core.cco.cco import *  # noqa: F401,F403
from mori_core.cco.cco import GDA_CONNECTION_CROSSNODE, GDA_CONNECTION_NONE, GDA_CONNECTION_RAIL  # noqa: F401
