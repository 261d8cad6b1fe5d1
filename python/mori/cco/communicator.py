"""Alias of :mod:`mori_core.cco.communicator` under MORI's name."""

from mori_core.cco.communicator import *  # noqa: F401,F403
