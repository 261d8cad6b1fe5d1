"""mori_core.io.expand_block_segments: the KV planners' expansion and merge, in the core."""

from __future__ import annotations

import numpy as np
import pytest

from mori_core.io import expand_block_segments


def _reference(runs, src_blocks, dst_blocks):
    """The numpy expansion the vLLM planner used before, then the join of segments that continue
    each other on both sides (mori_integrations.common.segments.merge_adjacent)."""
    lo, ro, sz = [], [], []
    for off_s, off_d, stride_s, stride_d, t_s, t_d, t_z in runs:
        lo.append((off_s[:, None, None] + (src_blocks * stride_s)[None, :, None] + t_s[None, None, :]).ravel())
        ro.append((off_d[:, None, None] + (dst_blocks * stride_d)[None, :, None] + t_d[None, None, :]).ravel())
        sz.append(np.broadcast_to(t_z, (off_s.size, src_blocks.size, t_z.size)).ravel())
    lo, ro, sz = np.concatenate(lo), np.concatenate(ro), np.concatenate(sz)
    if sz.size == 0:
        return lo, ro, sz
    joins = (lo[:-1] + sz[:-1] == lo[1:]) & (ro[:-1] + sz[:-1] == ro[1:])
    breaks = np.flatnonzero(~joins) + 1
    starts = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [sz.size - 1]))
    return lo[starts], ro[starts], lo[last] + sz[last] - lo[starts]


def _i64(*v):
    return np.array(v, dtype=np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_expansion_equals_the_numpy_plan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    blocks = 48
    runs = []
    for r in range(1 + seed % 3):  # one to three runs of layers
        layers = int(rng.integers(1, 6))
        whole = seed % 2 == 0  # whole blocks (one piece, contiguous blocks merge) or head slices
        t_s = _i64(0) if whole else _i64(0, 64, 128)
        t_d = _i64(0) if whole else _i64(32, 96, 160)
        t_z = _i64(256) if whole else _i64(32, 32, 32)
        stride = 256
        off = np.arange(layers, dtype=np.int64) * stride * 100 + r * 10**6
        runs.append((off, off + 7 * stride, stride, stride, t_s, t_d, t_z))
    if seed < 3:  # contiguous on both sides: everything of a layer merges
        src, dst = np.arange(5, 5 + blocks, dtype=np.int64), np.arange(9, 9 + blocks, dtype=np.int64)
    else:
        src = rng.permutation(90)[:blocks].astype(np.int64)
        dst = rng.permutation(90)[:blocks].astype(np.int64)
        dst[10:20] = np.arange(40, 50)  # a stretch contiguous on the destination only
        src[20:30] = np.arange(60, 70)
        dst[20:30] = np.arange(70, 80)  # and one contiguous on both sides
    got = expand_block_segments(runs, src, dst)
    want = _reference(runs, src, dst)
    for g, w in zip(got, want):
        assert g.dtype == np.int64 and np.array_equal(g, w)
    assert int(got[2].sum()) == sum(o.size * blocks * int(z.sum()) for o, _, _, _, _, _, z in runs)


def test_merges_across_layers_and_runs_and_takes_other_int_arrays() -> None:
    # layer 1 starts where layer 0's last block ends on both sides: one segment for both layers
    runs = [(_i64(0, 300), _i64(0, 300), 100, 100, _i64(0), _i64(0), _i64(100)),
            (_i64(600), _i64(600), 100, 100, _i64(0), _i64(0), _i64(100))]
    lo, ro, sz = expand_block_segments(runs, np.array([0, 1, 2], dtype=np.int32), [0, 1, 2])
    assert (lo.tolist(), ro.tolist(), sz.tolist()) == ([0], [0], [900])
    lo, ro, sz = expand_block_segments(runs, _i64(), _i64())
    assert lo.size == ro.size == sz.size == 0


def test_bad_arguments_are_named() -> None:
    run = (_i64(0), _i64(0), 8, 8, _i64(0), _i64(0), _i64(8))
    with pytest.raises(ValueError, match="src_blocks and dst_blocks differ in length"):
        expand_block_segments([run], _i64(1, 2), _i64(1))
    with pytest.raises(ValueError, match=r"runs\[0\]: layer offsets or template arrays differ"):
        expand_block_segments([(_i64(0, 1), _i64(0), 8, 8, _i64(0), _i64(0), _i64(8))], _i64(1), _i64(1))
    with pytest.raises(TypeError, match=r"src_blocks must be 1-D"):
        expand_block_segments([run], np.zeros((2, 2), dtype=np.int64), _i64(1, 2))
    with pytest.raises(TypeError, match=r"runs\[0\] must be a sequence of 7 items"):
        expand_block_segments([run[:6]], _i64(1), _i64(1))
