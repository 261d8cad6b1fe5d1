"""Alias of :mod:`mori_core.shmem` under MORI's name."""

from mori_core.shmem import *  # noqa: F401,F403
