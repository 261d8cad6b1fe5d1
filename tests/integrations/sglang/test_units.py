"""Unit tests of the adapter's pure parts: message bounds, byte plans, plugin failure mode."""

from __future__ import annotations

import sys

import msgspec
import numpy as np
import pytest

from mori_integrations.sglang import messages as m
from mori_integrations.sglang import plugin
from mori_integrations.sglang.plans import HeadSlice, PlanError, contiguous_segments, head_slice_segments, index_runs


def _metadata(**over) -> m.TransferMetadata:
    fields = dict(
        room=7, endpoint="10.0.0.1", rank_port=5555, engine_key="k", kv_pages=np.arange(4, dtype="<i4").tobytes(),
        aux_index=3, state_indices=[[1, 2]], required_dst_info_num=1, decode_prefix_len=0, is_dummy=False,
    )
    fields.update(over)
    return m.TransferMetadata(**fields)


def test_metadata_round_trip() -> None:
    got = m.decode_message(m.encode_message(_metadata()))
    assert isinstance(got, m.TransferMetadata)
    assert got.page_indices().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "frames, why",
    [
        ([m.WIRE_GUARD, m.KIND_METADATA, msgspec.msgpack.encode({**msgspec.structs.asdict(_metadata()), "rank_port": 0})], "port"),
        ([m.WIRE_GUARD, m.KIND_METADATA, msgspec.msgpack.encode({**msgspec.structs.asdict(_metadata()), "extra": 1})], "unknown field"),
        ([m.WIRE_GUARD, m.KIND_METADATA, msgspec.msgpack.encode({**msgspec.structs.asdict(_metadata()), "kv_pages": b"\x01\x02\x03"})], "int32"),
        ([m.WIRE_GUARD, m.KIND_METADATA, msgspec.msgpack.encode({**msgspec.structs.asdict(_metadata()), "kv_pages": np.array([-1], "<i4").tobytes()})], "negative"),
        ([m.WIRE_GUARD, m.KIND_STATUS, b"x" * (m.MAX_BODY_BYTES[m.KIND_STATUS] + 1)], "limit"),
        ([m.WIRE_GUARD, b"HUH", b""], "unknown"),
        ([b"other", m.KIND_STATUS, b""], "not a mori-suite"),
    ],
)
def test_bad_messages_are_rejected_with_a_reason(frames, why: str) -> None:
    with pytest.raises(m.ControlMessageError) as e:
        m.decode_message(frames)
    assert why.split()[0].lower() in str(e.value).lower() or why in str(e.value)


def test_state_index_list_is_bounded() -> None:
    body = msgspec.msgpack.encode({**msgspec.structs.asdict(_metadata()), "state_indices": [[0]] * (m.MAX_STATE_COMPONENTS + 1)})
    with pytest.raises(m.ControlMessageError, match="length"):
        m.decode_message([m.WIRE_GUARD, m.KIND_METADATA, body])


def test_index_runs_split_where_either_side_jumps() -> None:
    s, d, n = index_runs(np.array([3, 4, 5, 9, 10]), np.array([0, 1, 7, 8, 9]))
    assert s.tolist() == [3, 5, 9] and d.tolist() == [0, 7, 8] and n.tolist() == [2, 1, 2]
    assert contiguous_segments(np.array([3, 4]), np.array([0, 1]), 10, 10) == ([30], [0], [20])
    with pytest.raises(PlanError):
        contiguous_segments(np.array([1]), np.array([1]), 10, 12)


def test_head_slice_segments_tp2_to_tp1() -> None:
    # 4 heads of 2 bytes, page_size 2: prefill rank 1 holds heads 2..3, decode (TP1) all 4.
    heads = HeadSlice(src_heads=2, dst_heads=4, src_head_start=0, dst_head_start=2, num_heads=2)
    lo, ro, sz = head_slice_segments(np.array([1]), np.array([3]), 2, 2 * 2 * 2, 2 * 4 * 2, heads)
    assert lo.tolist() == [8, 12] and ro.tolist() == [3 * 16 + 4, 3 * 16 + 8 + 4] and sz.tolist() == [4, 4]
    with pytest.raises(PlanError):
        head_slice_segments(np.array([1]), np.array([3]), 2, 7, 16, heads)


def test_failed_plugin_makes_the_backend_fail_loudly(monkeypatch) -> None:
    saved = sys.modules.get(plugin.STOCK_MODULE)
    monkeypatch.setattr(plugin, "_sglang_version", lambda: "0.5.9")
    try:
        with pytest.raises(plugin.PluginError, match="0.5.23"):
            plugin.register()
        stub = sys.modules[plugin.STOCK_MODULE]
        with pytest.raises(ImportError, match="supports sglang==0.5.23"):
            stub.MoriKVManager  # what get_kv_class(MORI, ...) would import
        assert not plugin.is_active()
    finally:
        if saved is None:
            sys.modules.pop(plugin.STOCK_MODULE, None)
        else:
            sys.modules[plugin.STOCK_MODULE] = saved
