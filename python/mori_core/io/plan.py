"""Segment lists of KV-cache transfers, computed in the core (one call per request)."""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import numpy.typing as npt

from mori_core import _C

__all__ = ["BlockRun", "expand_block_segments"]

I64 = npt.NDArray[np.int64]
#: One run of layers of one geometry: (source layer offsets, destination layer offsets, source block
#: stride, destination block stride, template source offsets, template destination offsets,
#: template sizes). Offsets and sizes in bytes; the arrays 1-D int64.
BlockRun = Tuple[I64, I64, int, int, I64, I64, I64]


def expand_block_segments(runs: Sequence[BlockRun], src_blocks: I64, dst_blocks: I64) -> Tuple[I64, I64, I64]:
    """``(source offsets, destination offsets, sizes)`` of every run x layer x block pair x
    template piece, in that order, merged where a segment continues the one before it on both
    sides (also across layers and runs).

    Layer ``l`` of a run has block ``b`` at ``layer_offset[l] + b * block_stride`` on each side;
    ``src_blocks[i]`` pairs with ``dst_blocks[i]``; each block pair moves the template's pieces
    (offsets relative to the two block starts). What a numpy expansion and merge did in 80-170 us
    of a 2,048-token request on an idle Xeon host, in one pass without temporaries.

    Raises ValueError when ``src_blocks`` and ``dst_blocks`` (or a run's arrays) differ in length,
    TypeError for arrays that are not 1-D integers.
    """
    return _C.expand_block_segments(runs, src_blocks, dst_blocks)
