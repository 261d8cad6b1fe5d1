"""XGMI batches of many pieces and many region pairs (issue 27), GPU 0 -> GPU 1 in two processes.

What a KV request looks like to the engine: one ``batch_write`` over 64 region pairs (a
32-layer model's K and V buffers), thousands of scattered pages, read and write; a batch
mixing GPU pairs, a host-memory pair and a bad pair; the kernel's segment table and grid
settings (``MORI_IO_XGMI_MAX_BLOCKS``, pieces); with 4 GPUs, one batch initiated from two GPUs
into two others. Every byte is compared, and the bytes around each destination too.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mori_core import _C  # noqa: E402
from mori_core.io import BackendType, IOEngine, IOEngineConfig, StatusCode, XgmiBackendConfig  # noqa: E402

from io_gpu_peer import GpuTarget  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

PAGE = 4096


def _initiator(key: str) -> IOEngine:
    e = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0, enable_auto_xgmi=False))
    e.create_backend(BackendType.XGMI, XgmiBackendConfig())
    e.create_backend(BackendType.TCP)
    return e


def _rand(n: int, device: str, seed: int) -> "torch.Tensor":
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


@pytest.fixture(scope="module")
def pair():
    target = GpuTarget("batch-target", backends=("XGMI", "TCP"))
    init = _initiator("batch-init")
    init.register_remote_engine(target.desc)
    target.call("remote", init.get_engine_desc().pack())
    yield init, target
    target.close()


def _wait(init: IOEngine, statuses) -> None:
    assert init.wait_all(statuses, 30_000) == StatusCode.SUCCESS, [s.Message() for s in statuses]


@pytest.mark.parametrize("op", ["write", "read"])
def test_one_batch_over_64_region_pairs(pair, op: str) -> None:
    """64 remote buffers (per-layer K and V), 48 scattered pages each, one engine batch call."""
    init, target = pair
    n_regions, pages, slots = 64, 48, 64
    rng = np.random.default_rng(7)
    local = [torch.full((slots * PAGE,), 0xA5, dtype=torch.uint8, device="cuda:0") for _ in range(n_regions)]
    payload = [_rand(slots * PAGE, "cuda:0", 100 + k) for k in range(n_regions)]
    lms, rms, lo, ro, uids = [], [], [], [], []
    for k in range(n_regions):
        name = f"{op}-r{k}"
        rms.append(target.alloc(name, slots * PAGE, 1))
        if op == "write":
            local[k].copy_(payload[k])
            target.call("fill", (name, 0x5A))
        else:
            target.call("put", (name, 0, payload[k].cpu().numpy().tobytes()))
        lms.append(init.register_torch_tensor(local[k]))
        lo.append(rng.permutation(slots)[:pages].astype(np.int64) * PAGE)
        ro.append(rng.permutation(slots)[:pages].astype(np.int64) * PAGE)
        uids.append(init.allocate_transfer_uid())
    assert init.route_of(lms[0], rms[0]) == BackendType.XGMI
    f = init.batch_write if op == "write" else init.batch_read
    sizes = [np.full(pages, PAGE, dtype=np.int64)] * n_regions
    _wait(init, f(lms, lo, rms, ro, sizes, uids))
    torch.cuda.synchronize()
    for k in range(n_regions):
        src = payload[k].cpu()
        if op == "write":
            got = torch.frombuffer(bytearray(target.call("get", (f"{op}-r{k}", 0, slots * PAGE))), dtype=torch.uint8)
            want = torch.full((slots * PAGE,), 0x5A, dtype=torch.uint8)
            for a, b in zip(lo[k], ro[k]):
                want[b:b + PAGE] = src[a:a + PAGE]
        else:
            got = local[k].cpu()
            want = torch.full((slots * PAGE,), 0xA5, dtype=torch.uint8)
            for a, b in zip(lo[k], ro[k]):
                want[a:a + PAGE] = src[b:b + PAGE]
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"region {k}: {bad.numel()} bytes differ, first at {bad[0].item()}"
    if op == "write":  # every pair's notification follows its data
        deadline = time.monotonic() + 5
        pending = set(uids)
        while pending and time.monotonic() < deadline:
            pending = {u for u in pending if target.call("pop", (init.get_engine_desc().key, u)) is None}
            time.sleep(0.01)
        assert not pending, f"{len(pending)} pairs without a notification"
    for k in range(n_regions):
        init.deregister_memory(lms[k])
        target.call("free", f"{op}-r{k}")


@pytest.mark.parametrize("op, n, piece", [("write", 8192, 2048), ("read", 8192, 2048), ("read", 1024, 40_003)],
                         ids=["write", "read", "large-read"])
def test_8192_scattered_pieces_one_session_call(pair, op: str, n: int, piece: int) -> None:
    """More segments than a kernel's parameters carry: the segment table path, one launch.
    large-read: 39 MiB, above the size where reads take larger kernel pieces
    (MORI_IO_XGMI_READ_PIECE_BYTES), with segments that are no multiple of a piece."""
    init, target = pair
    span = 2 * n * piece
    name = f"table-{op}"
    rm = target.alloc(name, span, 1)
    payload = _rand(span, "cuda:0", 11)
    local = torch.full((span,), 0xA5, dtype=torch.uint8, device="cuda:0")
    if op == "write":
        local.copy_(payload)
        target.call("fill", (name, 0x5A))
    else:
        target.call("put", (name, 0, payload.cpu().numpy().tobytes()))
    lm = init.register_torch_tensor(local)
    sess = init.create_session(lm, rm)
    lo = np.arange(n, dtype=np.int64) * 2 * piece
    ro = np.random.default_rng(3).permutation(n).astype(np.int64) * 2 * piece + 8  # odd: not 16-byte aligned
    f = sess.batch_write if op == "write" else sess.batch_read
    _C.io_profile(True)
    try:
        st = f(lo, ro, np.full(n, piece, dtype=np.int64), sess.allocate_transfer_uid())
        path = _C.io_profile_last()["path"]
    finally:
        _C.io_profile(False)
    assert st.WaitFor(30_000) == StatusCode.SUCCESS, st.Message()
    assert path == "kernel", path
    torch.cuda.synchronize()
    src = payload.cpu().numpy()
    if op == "write":
        got = np.frombuffer(target.call("get", (name, 0, span)), dtype=np.uint8)
        want = np.full(span, 0x5A, dtype=np.uint8)
        idx_dst, idx_src = ro, lo
    else:
        got = local.cpu().numpy()
        want = np.full(span, 0xA5, dtype=np.uint8)
        idx_dst, idx_src = lo, ro
    cols = np.arange(piece, dtype=np.int64)
    want[(idx_dst[:, None] + cols).ravel()] = src[(idx_src[:, None] + cols).ravel()]
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[0]}"
    init.deregister_memory(lm)
    target.call("free", name)


def test_batch_mixing_gpu_pairs_host_memory_and_a_bad_pair(pair) -> None:
    """Each pair ends on its own: GPU pairs in one launch, pinned host memory by copy engines,
    an out-of-bounds pair refused before anything moves."""
    init, target = pair
    size = 64 * 1024
    rms = [target.alloc(f"mix-{k}", 2 * size, 1) for k in range(3)]
    for k in range(3):
        target.call("fill", (f"mix-{k}", 0))
    srcs = [_rand(size, "cuda:0", 20 + k) for k in range(2)]
    host = _rand(size, "cpu", 30).pin_memory()
    lms = [init.register_torch_tensor(t) for t in srcs] + [init.register_torch_tensor(host)]
    uids = [init.allocate_transfer_uid() for _ in range(4)]
    sts = init.batch_write(
        [lms[0], lms[2], lms[1], lms[0]],
        [[0], [0], [0], [0]],
        [rms[0], rms[1], rms[2], rms[2]],
        [[100], [size], [3], [2 * size - 10]],  # the last one runs past the region
        [[size], [size], [size - 5], [size]],
        uids,
    )
    assert sts[3].WaitFor(1000) == StatusCode.ERR_INVALID_ARGS, sts[3].Message()
    _wait(init, sts[:3])
    get = lambda k: np.frombuffer(target.call("get", (f"mix-{k}", 0, 2 * size)), dtype=np.uint8)  # noqa: E731
    assert np.array_equal(get(0)[100:100 + size], srcs[0].cpu().numpy())
    assert np.array_equal(get(1)[size:], host.numpy())
    assert np.array_equal(get(2)[3:3 + size - 5], srcs[1].cpu().numpy()[:size - 5])
    assert not get(0)[:100].any() and not get(2)[size - 2:].any()  # the refused pair wrote nothing
    for lm in lms:
        init.deregister_memory(lm)
    for k in range(3):
        target.call("free", f"mix-{k}")


@pytest.mark.parametrize("env", [{"MORI_IO_XGMI_MAX_BLOCKS": "3", "MORI_IO_XGMI_PIECE_BYTES": "4K"},
                                 {"MORI_IO_XGMI_MAX_BLOCKS": "1000", "MORI_IO_XGMI_BLOCK_THREADS": "512"}],
                         ids=["3-blocks-4K-pieces", "1000-blocks-512-threads"])
def test_grid_settings_move_the_same_bytes(pair, env, monkeypatch) -> None:
    """A capped grid walks many pieces per block across segment ends (sizes not multiples of the
    piece, odd offsets); empty and 1-byte segments included."""
    _, target = pair
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    init = _initiator(f"grid-init-{env['MORI_IO_XGMI_MAX_BLOCKS']}")
    init.register_remote_engine(target.desc)
    span = 16 << 20  # slots of 80 KiB: no two destinations overlap (the largest segment is 64 KiB + 3)
    name = f"grid-{env['MORI_IO_XGMI_MAX_BLOCKS']}"
    rm = target.alloc(name, span, 1)
    target.call("fill", (name, 0x5A))
    payload = _rand(span, "cuda:0", 5)
    lm = init.register_torch_tensor(payload)
    rng = np.random.default_rng(9)
    sizes = np.concatenate([[0, 1, 4095, 4097, 65536 + 3], rng.integers(1, 40_000, 200)]).astype(np.int64)
    slots = span // len(sizes)
    assert slots >= int(sizes.max()) + 7, "overlapping destinations would make the expected bytes ambiguous"
    lo = np.arange(len(sizes), dtype=np.int64) * slots + 1
    ro = rng.permutation(len(sizes)).astype(np.int64) * slots + 7
    sess = init.create_session(lm, rm)
    st = sess.batch_write(lo, ro, sizes, sess.allocate_transfer_uid())
    assert st.WaitFor(30_000) == StatusCode.SUCCESS, st.Message()
    got = np.frombuffer(target.call("get", (name, 0, span)), dtype=np.uint8)
    want = np.full(span, 0x5A, dtype=np.uint8)
    src = payload.cpu().numpy()
    for a, b, n in zip(lo, ro, sizes):
        want[b:b + n] = src[a:a + n]
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[0]}"
    init.deregister_memory(lm)
    target.call("free", name)


@pytest.mark.parametrize("var, value, says", [("MORI_IO_XGMI_MAX_BLOCKS", "70000", "must be in"),
                                             ("MORI_IO_XGMI_READ_PIECE_BYTES", "3000", "must be a power of two")])
def test_bad_grid_setting_is_named(monkeypatch, var: str, value: str, says: str) -> None:
    monkeypatch.setenv(var, value)
    e = IOEngine(f"grid-bad-{var}", IOEngineConfig(host="127.0.0.1", port=0, enable_auto_xgmi=False))
    with pytest.raises(Exception, match=f"{var}={value} {says}"):
        e.create_backend(BackendType.XGMI, XgmiBackendConfig())


def test_one_batch_from_two_gpus_into_two_others() -> None:
    """4 GPUs: local buffers on GPUs 0 and 1, remote on 2 and 3; one batch_write of the four
    combinations (one launch per initiating GPU)."""
    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 GPUs, {torch.cuda.device_count()} visible")
    target = GpuTarget("quad-target", backends=("XGMI", "TCP"))
    try:
        init = _initiator("quad-init")
        init.register_remote_engine(target.desc)
        size = 1 << 20
        rms = {d: target.alloc(f"q{d}", 4 * size, d) for d in (2, 3)}
        for d in (2, 3):
            target.call("fill", (f"q{d}", 0))
        srcs = {d: _rand(2 * size, f"cuda:{d}", d) for d in (0, 1)}
        lms = {d: init.register_torch_tensor(srcs[d]) for d in (0, 1)}
        pairs = [(0, 2, 0), (0, 3, 1), (1, 2, 2), (1, 3, 3)]  # (local GPU, remote GPU, slot)
        sts = init.batch_write([lms[a] for a, _, _ in pairs], [[0, size]] * 4, [rms[b] for _, b, _ in pairs],
                               [[s * size // 2, 2 * size + s * size // 2] for _, _, s in pairs],
                               [[size // 2, size // 2]] * 4, [init.allocate_transfer_uid() for _ in pairs])
        _wait(init, sts)
        for a, b, s in pairs:
            got = np.frombuffer(target.call("get", (f"q{b}", 0, 4 * size)), dtype=np.uint8)
            src = srcs[a].cpu().numpy()
            assert np.array_equal(got[s * size // 2:(s + 1) * size // 2], src[:size // 2]), (a, b)
            assert np.array_equal(got[2 * size + s * size // 2:2 * size + (s + 1) * size // 2],
                                  src[size:size + size // 2]), (a, b)
    finally:
        target.close()
