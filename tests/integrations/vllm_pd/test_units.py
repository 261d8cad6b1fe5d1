"""Pure parts of the PD connector: config, request params, KV geometry, planning, TP mapping, codec."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("msgspec")

from mori_integrations.common.control_codec import ControlMessageError  # noqa: E402
from mori_integrations.common.segments import PlanError  # noqa: E402
from mori_integrations.vllm.kv_connector.agent import pair_blocks  # noqa: E402
from mori_integrations.vllm.kv_connector.config import ConnectorConfig, rank_port  # noqa: E402
from mori_integrations.vllm.kv_connector.layout import strided_runs  # noqa: E402
from mori_integrations.vllm.kv_connector.messages import ConsumerDone, GetMeta, LayerLayout, make_codec  # noqa: E402
from mori_integrations.vllm.kv_connector.params import (  # noqa: E402
    ParamsError,
    block_lists,
    engine_id_of,
    instance_id_of,
    mode_of,
    peer_of,
    transfer_id_of,
)
from mori_integrations.vllm.kv_connector.planner import LayerPlanner, plan_layer, zip_runs  # noqa: E402
from mori_integrations.vllm.kv_connector.tp_mapping import head_pairs, heads_of_rank  # noqa: E402

MORIIO_EXTRA = {  # a MoRIIOConnector kv_connector_extra_config, keys unchanged
    "handshake_port": 6301, "notify_port": 61005, "read_mode": True, "backend": "rdma", "qp_per_transfer": 2,
    "post_batch_size": 64, "num_workers": 4, "transfer_timeout": 20, "defer_timeout": 90,
    "recv_abort_timeout": 60, "host_ip": "10.1.2.3", "http_port": 8100, "proxy_ip": "10.0.0.9",
    "proxy_ping_port": 36367,
}


def test_moriio_extra_config_is_accepted_unchanged() -> None:
    c = ConnectorConfig.from_extra(MORIIO_EXTRA)
    assert (c.handshake_port, c.notify_port, c.default_mode, c.backend) == (6301, 61005, "read", "rdma")
    assert (c.rdma.qp_per_transfer, c.rdma.post_batch_size, c.rdma.num_worker_threads) == (2, 64, 4)
    assert (c.transfer_timeout_s, c.defer_timeout_s, c.recv_abort_timeout_s) == (20, 90, 60)
    assert (c.host_ip, c.http_port, c.proxy_ip, c.proxy_ping_port) == ("10.1.2.3", 8100, "10.0.0.9", 36367)
    d = ConnectorConfig.from_extra({})
    assert (d.handshake_port, d.notify_port, d.default_mode, d.backend) == (6301, 61005, "write", "auto")
    assert d.xgmi_proxy_blocks == 0 and ConnectorConfig.from_extra({"xgmi_proxy_blocks": 8}).xgmi_proxy_blocks == 8
    assert d.handshake_ttl_s == 5.0 and ConnectorConfig.from_extra({"handshake_ttl": 0}).handshake_ttl_s == 0


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"backend": "nccl"}, "['backend'] must be one of ['auto', 'tcp', 'xgmi', 'rdma']"),
        ({"handshake_port": 70000}, "['handshake_port'] must be an int in [1, 65535], got 70000"),
        ({"read_mode": "maybe"}, "['read_mode'] must be a bool"),
        ({"transfer_timeout": 30, "recv_abort_timeout": 10}, "recv_abort_timeout (10 s) must exceed transfer_timeout"),
        ({"proxy_ip": "10.0.0.1"}, "['proxy_ping_port'] must be set"),
        ({"transfer_timeout": "soon"}, "['transfer_timeout'] must be a number"),
        ({"xgmi_proxy_blocks": 65}, "['xgmi_proxy_blocks'] must be an int in [0, 64], got 65"),
        ({"handshake_ttl": -1}, "['handshake_ttl'] must be a number in [0.0, 86400.0], got -1"),
    ],
)
def test_bad_config_names_key_and_limit(extra, message) -> None:
    with pytest.raises(ValueError) as e:
        ConnectorConfig.from_extra(extra)
    assert message in str(e.value) and "MoriSuiteConnector" in str(e.value)


def test_rank_ports_follow_moriio_and_are_bounded() -> None:
    assert rank_port(6301, 1, 4, 2) == 6307
    with pytest.raises(ValueError, match="outside"):
        rank_port(65530, 2, 4, 3)


def test_request_params() -> None:
    assert transfer_id_of("cmpl-abc-0-1a2b3c4d", {}) == "abc"
    assert transfer_id_of("x", {"transfer_id": "t"}) == "t"
    with pytest.raises(ParamsError):
        transfer_id_of("x", {"transfer_id": ""})
    assert mode_of({}, "write") == "write" and mode_of({"transfer_mode": "read"}, "write") == "read"
    assert engine_id_of({}) is None and engine_id_of({"remote_engine_id": "e1"}) == "e1"
    with pytest.raises(ParamsError, match="remote_engine_id must be a non-empty string"):
        engine_id_of({"remote_engine_id": 7})
    assert instance_id_of({}) is None and instance_id_of({"remote_instance_id": "abc"}) == "abc"
    with pytest.raises(ParamsError, match="remote_instance_id must be a non-empty string"):
        instance_id_of({"remote_instance_id": ["abc"]})
    peer = peer_of("r", {"remote_host": "h", "remote_handshake_port": "7000", "remote_notify_port": 7001,
                         "remote_dp_rank": 1, "remote_tp_size": 4})
    assert (peer.host, peer.handshake_port, peer.notify_port, peer.dp_rank, peer.tp_size_hint) == ("h", 7000, 7001, 1, 4)
    routed = peer_of("___prefill_addr_host:10.0.0.1,handshake:6301,notify:61005___decode_addr_host:x,handshake:1,"
                     "notify:2_" + "0" * 32, {})
    assert (routed.host, routed.handshake_port, routed.notify_port) == ("10.0.0.1", 6301, 61005)
    with pytest.raises(ParamsError, match="remote_host"):
        peer_of("r", {})
    with pytest.raises(ParamsError, match="port"):
        peer_of("r", {"remote_host": "h", "remote_handshake_port": 0, "remote_notify_port": 1})
    assert block_lists([3, 4], 1) == [[3, 4]] and block_lists([[3], [4, 5]], 2) == [[3], [4, 5]]
    with pytest.raises(ParamsError, match="groups"):
        block_lists([[3], [4]], 1)


def test_strided_runs_merge_only_what_touches() -> None:
    assert strided_runs((2, 3), (12, 4), 4) == [(0, 24)]  # dense
    assert strided_runs((2, 3), (16, 4), 4) == [(0, 12), (16, 12)]  # padded rows
    assert strided_runs((3, 2), (4, 12), 4) == [(0, 4), (12, 4), (4, 4), (16, 4), (8, 4), (20, 4)]  # transposed
    with pytest.raises(ValueError, match="stride"):
        strided_runs((2, 2), (-8, 4), 4)


def test_zip_runs_cuts_at_both_sides_boundaries() -> None:
    s, d, n = zip_runs([(0, 10), (20, 10)], [(100, 5), (105, 15)])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 5, 20], [100, 105, 110], [5, 5, 10])
    with pytest.raises(PlanError, match="differ in size"):
        zip_runs([(0, 8)], [(0, 4)])


def _layer(**over) -> LayerLayout:
    base = dict(name="l", group=0, region=0, offset=1000, block_stride=64, head_stride=32, num_heads=2,
                head_runs=[(0, 32)], block_runs=[(0, 64)], content="float32:4x2")
    base.update(over)
    return LayerLayout(**base)


def test_plan_layer_merges_contiguous_blocks_and_slices_heads() -> None:
    a = _layer()
    lo, ro, sz = plan_layer(a, a, np.array([1, 2, 3, 7]), np.array([4, 5, 6, 0]), [(0, 0), (1, 1)])
    assert (lo, ro, sz) == ([1064, 1448], [1256, 1000], [192, 64])
    lo, ro, sz = plan_layer(a, _layer(num_heads=1, head_stride=32, block_stride=32, block_runs=[(0, 32)]),
                            np.array([1, 2]), np.array([5, 6]), [(1, 0)])
    assert (lo, ro, sz) == ([1096, 1160], [1160, 1192], [32, 32])  # contiguous only on the destination
    with pytest.raises(PlanError, match="KV format differs"):
        plan_layer(a, _layer(content="bfloat16:4x2"), np.array([1]), np.array([1]), [(0, 0)])


def test_layer_planner_equals_layer_by_layer_plans_joined() -> None:
    """Many layers in one pass (two geometries, scattered and contiguous blocks, head slices) give
    exactly the per-layer segments, in layer order, merged only where they continue each other."""
    rng = np.random.default_rng(5)
    a = [_layer(name=f"a{i}", offset=10_000 * i) for i in range(5)]
    b = [_layer(name=f"b{i}", offset=50_000 + 10_000 * i, num_heads=1, head_stride=32, block_stride=32,
                block_runs=[(0, 32)]) for i in range(3)]
    planner = LayerPlanner()
    for src_b, dst_b in ((np.arange(1, 9), np.arange(3, 11)), (rng.permutation(40)[:8] + 1, rng.permutation(40)[:8] + 1)):
        for layers, pairs in (([(x, x) for x in a], [(0, 0), (1, 1)]), ([(x, y) for x, y in zip(a, b)], [(1, 0)])):
            lo, ro, sz = planner.plan(layers, src_b, dst_b, pairs)
            want = [plan_layer(x, y, src_b, dst_b, pairs) for x, y in layers]
            flat = [np.concatenate([np.asarray(w[k], dtype=np.int64) for w in want]) for k in range(3)]
            assert int(sz.sum()) == int(flat[2].sum())
            # expand both to bytes-level (offset, length) runs and compare: merging may differ only at joins
            def cover(o, r, n):
                return sorted(zip(o.tolist(), r.tolist(), n.tolist()))
            got_bytes = [(x + k, y + k) for x, y, n in cover(lo, ro, sz) for k in range(0, n, 16)]
            want_bytes = [(x + k, y + k) for x, y, n in cover(*flat) for k in range(0, n, 16)]
            assert got_bytes == want_bytes
            assert len(sz) <= len(flat[2])
    with pytest.raises(PlanError, match="outside"):
        planner.plan([(a[0], a[0])], np.array([1]), np.array([1]), [(0, 5)])
    with pytest.raises(PlanError, match="2 source blocks but 1"):
        planner.plan([(a[0], a[0])], np.array([1, 2]), np.array([1]), [(0, 0)])


def test_prepared_layers_plan_like_the_pairs_and_merge_keeps_bytes() -> None:
    """A plan from prepare()'d layers (what the agent caches per peer) equals the plan from the
    pairs; merging joins exactly the segments that continue each other on both sides."""
    from mori_integrations.common.segments import merge_adjacent

    rng = np.random.default_rng(11)
    a = [_layer(name=f"a{i}", offset=10_000 * i) for i in range(4)]
    planner = LayerPlanner()
    layers = [(x, x) for x in a]
    prepared = planner.prepare(layers)
    for src_b, dst_b in ((np.arange(1, 9), np.arange(3, 11)), (rng.permutation(40)[:8] + 1, rng.permutation(40)[:8] + 1)):
        for pairs in ([(0, 0), (1, 1)], [(1, 0)], [(1, 1), (0, 0)]):
            got = planner.plan(prepared, src_b, dst_b, pairs)
            want = planner.plan(layers, src_b, dst_b, pairs)
            assert all(np.array_equal(g, w) for g, w in zip(got, want))
    lo = np.array([0, 10, 20, 50, 60], dtype=np.int64)
    ro = np.array([100, 110, 300, 310, 320], dtype=np.int64)
    sz = np.array([10, 10, 5, 10, 7], dtype=np.int64)
    assert merge_adjacent(lo, ro, sz) == ([0, 20, 50], [100, 300, 310], [20, 5, 17])
    scattered = (np.array([30, 0], dtype=np.int64), np.array([0, 30], dtype=np.int64), np.array([10, 10], dtype=np.int64))
    assert [x.tolist() for x in merge_adjacent(*scattered, as_lists=False)] == [[30, 0], [0, 30], [10, 10]]


def test_write_request_carries_the_consumer_metadata_encoded_once() -> None:
    """The consumer's metadata rides as raw msgpack (the same bytes as a nested struct); the
    producer decodes and validates it, and a bad one is refused by the codec."""
    import msgspec

    from mori_integrations.vllm.kv_connector.messages import AgentMetadata, WriteRequest, encoded_metadata

    meta = AgentMetadata(engine_id="e", engine_desc=b"d", regions=[b"r"], layers=[_layer()], tp_rank=0, tp_size=1,
                         dp_rank=0, total_kv_heads=2, replicated_heads=False, block_size=4, group_block_sizes=[4],
                         notify_host="127.0.0.1", notify_port=5000)
    req = WriteRequest(transfer_id="t", consumer=encoded_metadata(meta), block_ids=[[1, 2]], positions=[0], budget_ms=5)
    codec = make_codec("")
    got = codec.decode(codec.encode(req))
    assert got.consumer_meta == meta and got.block_ids == [[1, 2]]

    class Nested(msgspec.Struct):  # how the request looked before: same wire bytes
        transfer_id: str
        consumer: AgentMetadata
        block_ids: list
        positions: list
        budget_ms: int
        producer_key: str = ""
        doorbell_slot: int = -1
        doorbell_seq: int = 0

    assert msgspec.msgpack.encode(Nested("t", meta, [[1, 2]], [0], 5)) == msgspec.msgpack.encode(req)
    bad = msgspec.structs.replace(meta, tp_rank=3)  # out of range for tp_size 1
    stranger = msgspec.structs.replace(req, consumer=msgspec.Raw(b"\x81\xa1x\x01"))  # {"x": 1}
    with pytest.raises(ControlMessageError, match="consumer metadata"):  # never sent ...
        codec.encode(stranger)
    frames = codec.encode(req)
    with pytest.raises(ControlMessageError, match="consumer metadata"):  # ... nor accepted
        codec.decode([frames[0], frames[1], msgspec.msgpack.encode(stranger)])
    with pytest.raises(ControlMessageError, match="tp_rank 3 out of range"):
        WriteRequest(transfer_id="t", consumer=encoded_metadata(bad), block_ids=[], positions=[], budget_ms=5).validate()


def test_tp_head_mapping() -> None:
    assert heads_of_rank(8, 2, 1) == [4, 5, 6, 7] and heads_of_rank(2, 4, 3) == [1]
    assert head_pairs(8, 2, 1, 4, 2) == [(0, 0), (1, 1)]  # decode rank 2 holds heads 4,5 = prefill rank 1's first two
    assert head_pairs(8, 2, 0, 4, 2) == []
    assert head_pairs(2, 4, 3, 2, 1) == [(0, 0)] and head_pairs(2, 4, 2, 2, 1) == []  # replicas spread by decode rank
    with pytest.raises(ValueError, match="cannot be sharded"):
        heads_of_rank(6, 4, 0)


def test_block_pairs_skip_unneeded_positions_and_refuse_dropped_ones() -> None:
    s, d = pair_blocks([5, 6, 7, 8], [0, 0, 3, 4], null_block_id=0)  # sliding window: only the tail is needed
    assert (s.tolist(), d.tolist()) == ([7, 8], [3, 4])
    with pytest.raises(PlanError, match="no longer holds"):
        pair_blocks([0, 6], [2, 3], null_block_id=0)
    with pytest.raises(PlanError, match="expects 3 blocks"):
        pair_blocks([1, 2], [1, 2, 3], null_block_id=0)
    # no null block anywhere (lists, the usual case) and the same through arrays
    for src, dst in (([9, 1, 2, 3], [4, 5, 6]), (np.array([9, 1, 2, 3]), np.array([4, 5, 6]))):
        s, d = pair_blocks(src, dst, null_block_id=0)
        assert (s.tolist(), d.tolist()) == ([9, 1, 2], [4, 5, 6]) and s.dtype == d.dtype == np.int64
    with pytest.raises(PlanError, match="no longer holds"):
        pair_blocks(np.array([0, 6]), np.array([2, 3]), null_block_id=0)


def test_codec_authenticates_and_refuses_replays_and_strangers() -> None:
    a, b, none = make_codec("s3cret"), make_codec("s3cret"), make_codec("")
    frames = a.encode(GetMeta(requester="x"))
    assert len(frames) == 4 and b.decode(frames) == GetMeta(requester="x")
    with pytest.raises(ControlMessageError, match="replayed"):
        b.decode(frames)
    with pytest.raises(ControlMessageError, match="bad authentication"):
        make_codec("other").decode(a.encode(GetMeta(requester="x")))
    tampered = a.encode(ConsumerDone(transfer_id="t", consumer_key="k", consumer_rank=0, consumer_tp=1, ok=True, nbytes=1))
    tampered[2] = tampered[2].replace(b"\x01", b"\x02", 1)
    with pytest.raises(ControlMessageError):
        b.decode(tampered)
    with pytest.raises(ControlMessageError, match="no shared secret"):
        none.decode(a.encode(GetMeta(requester="x")))
    with pytest.raises(ControlMessageError, match="unauthenticated"):
        b.decode(none.encode(GetMeta(requester="x")))
    with pytest.raises(ControlMessageError, match="malformed"):
        none.decode([frames[0], b"CDONE", b"\x93\x01"])


def test_heartbeat_sends_moriio_registration_payload() -> None:
    import msgspec
    import zmq

    from mori_integrations.vllm.kv_connector.heartbeat import ProxyHeartbeat

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    payload = {"type": "P", "http_address": "10.0.0.1:8100", "zmq_address": "host:10.0.0.1,handshake:6301,notify:61005",
               "dp_size": 1, "tp_size": 2, "transfer_mode": "WRITE"}
    beat = ProxyHeartbeat(ctx, "127.0.0.1", port, payload)
    try:
        assert router.poll(10_000), "no registration within 10 s"
        _identity, body = router.recv_multipart()
        assert msgspec.msgpack.decode(body) == payload
    finally:
        beat.close()
        router.close(0)
        ctx.term()
    with pytest.raises(ValueError, match="http_port"):
        ConnectorConfig.from_extra({"proxy_ip": "10.0.0.9", "proxy_ping_port": 36367})


def test_layers_sharing_a_view_are_moved_once_per_group() -> None:
    torch = pytest.importorskip("torch")
    from mori_integrations.vllm.kv_connector.layout import describe_kv_caches

    view = torch.zeros(4, 2, 8, 16)
    layout = describe_kv_caches({"a": view, "b": view, "c": view}, {"a": 0, "b": 0, "c": 1}, num_blocks=4)
    # b shares a's cache in the same group (cross-layer sharing); c overlays it in another group (hybrid allocator)
    assert [(layer.name, layer.group) for layer in layout.layers] == [("a", 0), ("c", 1)]
    assert len(layout.regions) == 1


def _scheduler(role: str):
    """The scheduler side over the parts of vLLM's config it reads (vLLM itself is the other side)."""
    from types import SimpleNamespace

    from mori_integrations.vllm.kv_connector.scheduler import ConnectorScheduler

    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=role),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank_local=0))
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group])
    return ConnectorScheduler(vllm_config, ConnectorConfig.from_extra({"host_ip": "127.0.0.1"}), kv_cache_config,
                              "fixed-engine")


class _Request:
    def __init__(self, req_id: str, params: dict, tokens: int = 40) -> None:
        self.request_id, self.kv_transfer_params, self.num_prompt_tokens = req_id, params, tokens
        self.num_computed_tokens = 0


class _Blocks:
    def __init__(self, ids: list) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple:
        return (self.ids,)


def test_every_transfer_names_the_prefill_process_not_only_its_engine_id() -> None:
    """Issue #29 item 7: a fixed engine_id survives a restart, the scheduler's instance nonce does not."""
    first, second = _scheduler("kv_producer"), _scheduler("kv_producer")
    assert first.instance_id != second.instance_id and first.engine_id == second.engine_id
    assert first.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).instance_id == first.instance_id
    decode = _scheduler("kv_consumer")
    addr = {"remote_host": "127.0.0.1", "remote_handshake_port": 7000, "remote_notify_port": 7001,
            "remote_block_ids": [[5, 6, 7]], "remote_engine_id": "fixed-engine", "transfer_mode": "read"}
    for req_id, params in (("with", {**addr, "remote_instance_id": first.instance_id}), ("without", addr)):
        request = _Request(req_id, {**params, "do_remote_prefill": True})
        assert decode.get_num_new_matched_tokens(request, 0) == (40, True)
        decode.update_state_after_alloc(request, _Blocks([1, 2, 3]), 40)
    good, bad = decode.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).recv
    assert good.mode == "read" and good.remote_instance_id == first.instance_id
    # READ params without the process they came from cannot be trusted: the request fails (recompute/fail).
    assert bad.mode == "invalid" and "remote_instance_id" in bad.error


def test_the_prefill_response_carries_its_instance() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.request import RequestStatus

    prefill = _scheduler("kv_producer")
    request = _Request("p1", {"do_remote_decode": True, "transfer_id": "t1"})
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    prefill.update_state_after_alloc(request, _Blocks([4, 5, 6]), 0)
    prefill.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([4, 5, 6],), block_pool=None)
    plan = prefill.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"p1": 40}))
    assert [j.req_id for j in plan.send] == ["p1"] and plan.instance_id == prefill.instance_id
    delay, params = prefill.request_finished(request, ([4, 5, 6],))
    assert delay and params["remote_instance_id"] == prefill.instance_id
    assert params["remote_engine_id"] == "fixed-engine"


def test_vllm_pd_bench_refuses_nixl_when_it_is_not_installed() -> None:
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("nixl") is not None:
        pytest.skip("nixl is installed here")
    run = subprocess.run([sys.executable, "-m", "mori_core.bench", "vllm-pd", "--systems", "nixl"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert "nixl package is not installed" in run.stderr
