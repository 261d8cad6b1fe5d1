"""Alias of the compiled module, as MORI's ``mori.cpp`` (e.g. ``TransferStatus``)."""

from mori_core._C import *  # noqa: F401,F403
from mori_core._C import TransferStatus  # noqa: F401
