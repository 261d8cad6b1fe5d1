"""GPU IO tests: the XGMI backend (CUDA IPC) and the TCP backend with GPU memory.

Run on the GPU machine (tools/gpu_check.sh); skipped elsewhere with a reason.
Two processes on two GPUs, two processes on one GPU, CPU<->GPU; read/write x
engine/session x single/batch; 1 B .. 64 MiB; 64 and 1,024 scattered pages;
sub-allocated tensors; 10,000 back-to-back transfers with checksums; faults.
Every XGMI case runs twice: with launches, and with the resident copy proxy
(XgmiBackendConfig.proxy_blocks) taking what fits it.
"""

from __future__ import annotations

import hashlib
import time

import pytest

torch = pytest.importorskip("torch")

from mori_core import _C  # noqa: E402
from mori_core.io import (  # noqa: E402
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    StatusCode,
    XgmiBackendConfig,
)

from io_gpu_peer import GpuTarget  # noqa: E402

pytestmark = pytest.mark.gpu


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _initiator(key: str, backends=("TCP",), auto_xgmi: bool = True, xgmi: XgmiBackendConfig | None = None) -> IOEngine:
    e = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0, enable_auto_xgmi=auto_xgmi))
    for b in backends:
        if b == "XGMI" and xgmi is not None:
            e.create_backend(BackendType.XGMI, xgmi)
        else:
            e.create_backend(getattr(BackendType, b))
    return e


def _rand(n: int, device: str, seed: int) -> "torch.Tensor":
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _pair(param: str, xgmi: XgmiBackendConfig | None):
    if param.startswith("2gpu") and not _two_gpus():
        pytest.skip("needs 2 GPUs")
    tdev = 1 if param.startswith("2gpu") else 0
    target = GpuTarget(f"xgmi-target-{param}", backends=("XGMI", "TCP"))
    init = _initiator(f"xgmi-init-{param}", backends=("XGMI", "TCP"), xgmi=xgmi)
    init.register_remote_engine(target.desc)
    target.call("remote", init.get_engine_desc().pack())
    return init, target, tdev


@pytest.fixture(scope="module", params=["2gpu", "1gpu", "2gpu-proxy", "1gpu-proxy"])
def xgmi_pair(request):
    init, target, tdev = _pair(request.param, XgmiBackendConfig(proxy_blocks=4) if "proxy" in request.param else None)
    yield init, target, tdev
    target.close()


@pytest.fixture(scope="module", params=["2gpu-p", "1gpu-p"])
def proxy_pair(request):
    """A copy proxy that leaves after 200 us idle (the cases below watch it come and go)."""
    init, target, tdev = _pair(request.param, XgmiBackendConfig(proxy_blocks=4, proxy_idle_us=200))
    yield init, target, tdev
    target.close()


SIZES = [1, 4096, 1 << 20, 64 << 20]


@pytest.mark.parametrize("size", SIZES, ids=["1B", "4KiB", "1MiB", "64MiB"])
@pytest.mark.parametrize("shape", ["single", "batch"])
@pytest.mark.parametrize("api", ["engine", "session"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_xgmi_matrix(xgmi_pair, op, api, shape, size):
    init, target, tdev = xgmi_pair
    count = 1 if shape == "single" else 3
    span = 2 * size * count + 256
    name = f"m-{op}-{api}-{shape}-{size}"
    rm = target.alloc(name, span, tdev, offset=4096 + 48)  # sub-allocated: ipc_offset != 0
    assert rm.ipc_offset >= 4096 + 48
    local = torch.full((span,), 0xA5, dtype=torch.uint8, device="cuda:0")
    lm = init.register_torch_tensor(local)
    assert init.route_of(lm, rm) == BackendType.XGMI
    offs_l = [16 + i * 2 * size for i in range(count)]
    offs_r = [64 + i * 2 * size for i in range(count)]
    payload = _rand(span, "cuda:0", size + count)
    if op == "write":
        local.copy_(payload)
        target.call("fill", (name, 0x5A))
    else:
        target.call("put", (name, 0, payload.cpu().numpy().tobytes()))
    uid = init.allocate_transfer_uid()
    sess = init.create_session(lm, rm) if api == "session" else None
    read = op == "read"
    if shape == "single":
        if sess:
            st = [(sess.read if read else sess.write)(offs_l[0], offs_r[0], size, uid)]
        else:
            st = [(init.read if read else init.write)(lm, offs_l[0], rm, offs_r[0], size, uid)]
    elif sess:
        st = [(sess.batch_read if read else sess.batch_write)(offs_l, offs_r, [size] * count, uid)]
    else:
        st = (init.batch_read if read else init.batch_write)([lm], [offs_l], [rm], [offs_r], [[size] * count], [uid])
    assert init.wait_all(st, 30_000) == StatusCode.SUCCESS, [s.Message() for s in st]
    torch.cuda.synchronize()
    if op == "write":
        remote = torch.frombuffer(bytearray(target.call("get", (name, 0, span))), dtype=torch.uint8)
        for lo, ro in zip(offs_l, offs_r):
            assert torch.equal(remote[ro:ro + size], payload[lo:lo + size].cpu())
        assert remote[0] == 0x5A and remote[offs_r[0] - 1] == 0x5A  # untouched around
        deadline = time.monotonic() + 5
        while target.call("pop", (init.get_engine_desc().key, uid)) is None:  # notification follows the data
            assert time.monotonic() < deadline, "no XGMI notification at the target"
            time.sleep(0.01)
    else:
        for lo, ro in zip(offs_l, offs_r):
            assert torch.equal(local[lo:lo + size].cpu(), payload[ro:ro + size].cpu())
        assert local[0].item() == 0xA5
    init.deregister_memory(lm)
    target.call("free", name)


@pytest.mark.parametrize("pages", [64, 1024, 2500])  # 2500: more segments than one kernel launch carries
def test_xgmi_scattered_pages(xgmi_pair, pages):
    init, target, tdev = xgmi_pair
    page = 8192
    name = f"pages-{pages}"
    rm = target.alloc(name, 2 * pages * page, tdev)
    target.call("fill", (name, 0))
    src = _rand(pages * page, "cuda:0", pages)
    lm = init.register_torch_tensor(src)
    perm = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(pages))[:pages].tolist()
    offs_l = [i * page for i in range(pages)]
    offs_r = [p * page for p in perm]
    sess = init.create_session(lm, rm)
    st = sess.batch_write(offs_l, offs_r, [page] * pages, sess.allocate_transfer_uid())
    assert st.WaitFor(30_000) == StatusCode.SUCCESS, st.Message()
    remote = torch.frombuffer(bytearray(target.call("get", (name, 0, 2 * pages * page))), dtype=torch.uint8)
    host = src.cpu()
    for lo, ro in zip(offs_l, offs_r):
        assert torch.equal(remote[ro:ro + page], host[lo:lo + page])
    init.deregister_memory(lm)
    target.call("free", name)


def _staged_session(init, target, name: str, span: int, tdev: int, op: str, seed: int):
    """Remote buffer `name` and a local one of `span` bytes with a session between them; the
    random payload sits at the source end (local for a write, remote for a read), the other
    end is filled with a marker (local 0xA5, remote 0x5A). Returns (payload, local, lm, sess)."""
    rm = target.alloc(name, span, tdev)
    payload = _rand(span, "cuda:0", seed)
    local = torch.full((span,), 0xA5, dtype=torch.uint8, device="cuda:0")
    lm = init.register_torch_tensor(local)
    sess = init.create_session(lm, rm)
    if op == "write":
        local.copy_(payload)
        target.call("fill", (name, 0x5A))
    else:
        target.call("put", (name, 0, payload.cpu().numpy().tobytes()))
    return payload, local, lm, sess


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("arrays", ["list", "numpy"])
def test_xgmi_segments_across_kernel_pieces(xgmi_pair, op, arrays):
    """Sizes that are not multiples of the kernel's 16 KiB piece, aligned and misaligned,
    one segment far larger than the rest, given as lists or numpy arrays."""
    import numpy as np

    init, target, tdev = xgmi_pair
    span = 4 << 20
    name = f"pieces-{op}-{arrays}"
    offs_l = [0, 40_000, 200_003, 310_000, 1 << 20]
    offs_r = [2 << 20, 3, 500_000, 700_001, 1_000_000]
    sizes = [16384 + 1, 3 * 16384 - 7, 100_000, 1, (1 << 20) + 16]
    payload, local, lm, sess = _staged_session(init, target, name, span, tdev, op, 99)
    conv = (lambda v: np.asarray(v, dtype=np.int64)) if arrays == "numpy" else list
    f = sess.batch_write if op == "write" else sess.batch_read
    st = f(conv(offs_l), conv(offs_r), conv(sizes), sess.allocate_transfer_uid())
    assert st.WaitFor(30_000) == StatusCode.SUCCESS, st.Message()
    torch.cuda.synchronize()
    host = payload.cpu()
    if op == "write":
        remote = torch.frombuffer(bytearray(target.call("get", (name, 0, span))), dtype=torch.uint8)
        expected = torch.full((span,), 0x5A, dtype=torch.uint8)
        for lo, ro, n in zip(offs_l, offs_r, sizes):
            expected[ro:ro + n] = host[lo:lo + n]
        bad = (remote != expected).nonzero()
        assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[0].item()}"
    else:
        got = local.cpu()
        expected = torch.full((span,), 0xA5, dtype=torch.uint8)
        for lo, ro, n in zip(offs_l, offs_r, sizes):
            expected[lo:lo + n] = host[ro:ro + n]
        bad = (got != expected).nonzero()
        assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[0].item()}"
    init.deregister_memory(lm)
    target.call("free", name)


def test_xgmi_10000_back_to_back_with_checksums(xgmi_pair):
    init, target, tdev = xgmi_pair
    n, seg = 10_000, 512
    name = "b2b"
    rm = target.alloc(name, n * seg, tdev)
    src = _rand(n * seg, "cuda:0", 7)
    lm = init.register_torch_tensor(src)
    sess = init.create_session(lm, rm)
    statuses = []
    for i in range(n):
        statuses.append(sess.write(i * seg, (n - 1 - i) * seg, seg, sess.allocate_transfer_uid()))
        if len(statuses) >= 256:
            assert init.wait_all(statuses, 30_000) == StatusCode.SUCCESS
            statuses.clear()
    assert init.wait_all(statuses, 30_000) == StatusCode.SUCCESS
    remote = bytes(target.call("get", (name, 0, n * seg)))
    host = src.cpu().numpy().tobytes()
    expected = b"".join(host[(n - 1 - j) * seg:(n - j) * seg] for j in range(n))
    assert hashlib.sha256(remote).hexdigest() == hashlib.sha256(expected).hexdigest()
    init.deregister_memory(lm)
    target.call("free", name)


def test_cpu_to_gpu_and_back(xgmi_pair):
    """Initiator pinned host memory <-> target GPU memory in another process."""
    init, target, tdev = xgmi_pair
    name = "cpu-gpu"
    rm = target.alloc(name, 1 << 20, tdev)
    host = _rand(1 << 20, "cpu", 3).pin_memory()
    lm = init.register_torch_tensor(host)
    assert init.route_of(lm, rm) == BackendType.XGMI
    assert init.write(lm, 0, rm, 0, 1 << 20, 1).WaitFor(10_000) == StatusCode.SUCCESS
    assert bytes(target.call("get", (name, 0, 1 << 20))) == host.numpy().tobytes()
    back = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory()
    lb = init.register_torch_tensor(back)
    assert init.read(lb, 0, rm, 0, 1 << 20, 2).WaitFor(10_000) == StatusCode.SUCCESS
    assert torch.equal(back, host)
    # GPU memory of this process -> a CPU region of this process, through XGMI
    e2 = _initiator("same-process-peer", backends=("XGMI", "TCP"))
    cpu_dst = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    md = e2.register_torch_tensor(cpu_dst)
    init.register_remote_engine(e2.get_engine_desc())
    gsrc = _rand(4096, "cuda:0", 11)
    lg = init.register_torch_tensor(gsrc)
    assert init.route_of(lg, md) == BackendType.XGMI
    assert init.write(lg, 0, md, 0, 4096, 3).WaitFor(10_000) == StatusCode.SUCCESS
    assert torch.equal(cpu_dst, gsrc.cpu())
    assert _eventually(lambda: e2.pop_inbound_transfer_status(init.get_engine_desc().key, 3)) is not None
    target.call("free", name)


def _eventually(fn, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = fn()
        if r:
            return r
        time.sleep(0.01)
    return None


def test_xgmi_out_of_bounds_and_foreign_handle(xgmi_pair):
    init, target, tdev = xgmi_pair
    rm = target.alloc("oob", 4096, tdev)
    local = torch.zeros(8192, dtype=torch.uint8, device="cuda:0")
    lm = init.register_torch_tensor(local)
    st = init.write(lm, 0, rm, 4000, 200, 1)
    assert st.Code() == StatusCode.ERR_INVALID_ARGS
    # a descriptor whose IPC handle is garbage: clear error, no crash
    packed = bytearray(rm.pack())
    h = bytes(rm.ipc_handle)
    pos = packed.find(h)
    packed[pos:pos + 64] = bytes(range(64))
    foreign = MemoryDesc.unpack(bytes(packed))
    init2 = _initiator("foreign-init", backends=("XGMI",))
    init2.register_remote_engine(target.desc)
    l2 = init2.register_torch_tensor(local)
    st = init2.write(l2, 0, foreign, 0, 16, 2)
    assert st.WaitFor(10_000) == StatusCode.ERR_GPU_OP, st.Message()
    assert "IPC handle" in st.Message()
    target.call("free", "oob")


def test_xgmi_dead_peer_does_not_hang():
    target = GpuTarget("xgmi-victim", backends=("XGMI", "TCP"))
    init = _initiator("xgmi-survivor", backends=("XGMI", "TCP"))
    init.register_remote_engine(target.desc)
    rm = target.alloc("v", 16 << 20, 1 if _two_gpus() else 0)
    src = torch.ones(16 << 20, dtype=torch.uint8, device="cuda:0")
    lm = init.register_torch_tensor(src)
    assert init.write(lm, 0, rm, 0, 16 << 20, 1).WaitFor(10_000) == StatusCode.SUCCESS
    target.kill()
    t0 = time.monotonic()
    st = init.write(lm, 0, rm, 0, 16 << 20, 2)  # mapping still valid or refused: never a hang
    code = st.WaitFor(10_000)
    assert code != StatusCode.IN_PROGRESS and time.monotonic() - t0 < 10
    init.deregister_remote_engine(target.desc)  # closes the mapping of the dead peer


def _path_of(submit) -> tuple[object, str]:
    """Submits (``submit()`` returns a status) and says which XGMI engine took it."""
    _C.io_profile(True)
    try:
        st = submit()
        path = _C.io_profile_last()["path"]
    finally:
        _C.io_profile(False)
    return st, path


@pytest.mark.parametrize("op", ["write", "read"])
def test_xgmi_proxy_takes_what_fits_and_launches_the_rest(proxy_pair, op):
    """At most 64 segments and proxy_max_bytes (1 MiB) go to the resident grid;
    65 segments or 2 MiB are launched, 64 MiB segments use copy engines (several at
    once: one batched call). Every byte is checked."""
    init, target, tdev = proxy_pair
    span = 160 << 20
    name = f"proxy-routes-{op}"
    payload, local, lm, sess = _staged_session(init, target, name, span, tdev, op, 5)
    torch.cuda.synchronize()
    page = 8192
    # segments 2 pages apart (never merged), remote offsets reversed; no two cases overlap at either end
    cases = [
        ("one 8 KiB", [7 << 19], [64 << 20], [page], "proxy"),
        ("64 x 8 KiB", [i * 2 * page for i in range(64)], [(65 << 20) + (63 - i) * 2 * page for i in range(64)],
         [page] * 64, "proxy"),
        ("65 x 8 KiB", [(2 << 20) + i * 2 * page for i in range(65)],
         [(67 << 20) + (64 - i) * 2 * page for i in range(65)], [page] * 65, "kernel"),
        ("1 MiB, unaligned", [(4 << 20) + 3], [(70 << 20) + 5], [1 << 20], "proxy"),
        ("2 MiB", [6 << 20], [72 << 20], [2 << 20], "kernel"),
        ("64 MiB", [16 << 20], [80 << 20], [64 << 20], "copy_engines"),
        # 4 x 8 MiB apart (average above the kernel's 4 MiB): one cudaMemcpyBatchAsync (CUDA >= 13)
        ("4 x 8 MiB", [96 << 20, 112 << 20, 128 << 20, 144 << 20], [40 << 20, 24 << 20, 8 << 20, 56 << 20],
         [8 << 20] * 4, "copy_engine_batch"),
    ]
    f = sess.batch_write if op == "write" else sess.batch_read
    for what, lo, ro, sizes, expected in cases:
        st, path = _path_of(lambda: f(lo, ro, sizes, sess.allocate_transfer_uid()))
        assert st.WaitFor(30_000) == StatusCode.SUCCESS, (what, st.Message())
        assert path == expected, (what, path)
    torch.cuda.synchronize()
    host = payload.cpu()
    got = (torch.frombuffer(bytearray(target.call("get", (name, 0, span))), dtype=torch.uint8) if op == "write"
           else local.cpu())
    for what, lo, ro, sizes, _ in cases:
        for a, b, n in zip(lo, ro, sizes):
            dst, src = (b, a) if op == "write" else (a, b)
            assert torch.equal(got[dst:dst + n], host[src:src + n]), what
    init.deregister_memory(lm)
    target.call("free", name)


def _synchronize_returns(timeout: float = 5.0) -> bool:
    """torch.cuda.synchronize() in a thread: True if it returned (the resident grid left)."""
    import threading

    t = threading.Thread(target=torch.cuda.synchronize, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def test_xgmi_proxy_leaves_when_idle_and_comes_back(proxy_pair):
    """The grid leaves after proxy_idle_us, so a device-wide synchronize returns;
    the next transfer brings it back. 300 writes in flight overflow the 64-entry
    ring into launches without losing any."""
    init, target, tdev = proxy_pair
    n, seg = 300, 4096
    name = "proxy-idle"
    rm = target.alloc(name, 2 * n * seg, tdev)
    src = _rand(n * seg, "cuda:0", 11)
    lm = init.register_torch_tensor(src)
    sess = init.create_session(lm, rm)
    for rnd in range(3):
        st, path = _path_of(lambda: sess.write(0, rnd * seg, seg, sess.allocate_transfer_uid()))
        assert st.WaitFor(10_000) == StatusCode.SUCCESS, st.Message()
        assert path == "proxy"
        time.sleep(0.01)  # 50x the idle limit
        assert _synchronize_returns(), "torch.cuda.synchronize() still waits: the copy proxy did not leave"
    paths = []
    statuses = []
    _C.io_profile(True)
    try:
        for i in range(n):
            statuses.append(sess.write(i * seg, n * seg + (n - 1 - i) * seg, seg, sess.allocate_transfer_uid()))
            paths.append(_C.io_profile_last()["path"])
    finally:
        _C.io_profile(False)
    assert init.wait_all(statuses, 30_000) == StatusCode.SUCCESS, [s.Message() for s in statuses if s.Failed()][:3]
    assert "proxy" in paths
    remote = bytes(target.call("get", (name, 0, 2 * n * seg)))
    host = src.cpu().numpy().tobytes()
    for r in range(3):
        assert remote[r * seg:(r + 1) * seg] == host[:seg]
    expected = b"".join(host[(n - 1 - j) * seg:(n - j) * seg] for j in range(n))
    assert remote[n * seg:] == expected, f"{sum(p == 'proxy' for p in paths)} of {n} writes went to the proxy"
    init.deregister_memory(lm)
    target.call("free", name)


def test_xgmi_proxy_mixed_sizes_in_flight(proxy_pair):
    """Entries one block serves alone (4 KiB) between entries every block serves
    (256 KiB = 64 pieces), 128 in flight at a time, 640 in all: the ring wraps
    ten times while blocks skip entries; every byte is checked."""
    init, target, tdev = proxy_pair
    sizes = [4096 if i % 2 else 256 << 10 for i in range(640)]
    offs = [0]
    for n in sizes[:-1]:
        offs.append(offs[-1] + n)
    total = offs[-1] + sizes[-1]
    name = "proxy-mixed"
    rm = target.alloc(name, total, tdev)
    target.call("fill", (name, 0))
    src = _rand(total, "cuda:0", 21)
    lm = init.register_torch_tensor(src)
    sess = init.create_session(lm, rm)
    statuses = []
    for off, n in zip(offs, sizes):
        statuses.append(sess.write(off, total - off - n, n, sess.allocate_transfer_uid()))
        if len(statuses) >= 128:
            assert init.wait_all(statuses, 30_000) == StatusCode.SUCCESS
            statuses.clear()
    assert init.wait_all(statuses, 30_000) == StatusCode.SUCCESS
    remote = bytes(target.call("get", (name, 0, total)))
    host = src.cpu().numpy().tobytes()
    for off, n in zip(offs, sizes):
        assert remote[total - off - n:total - off] == host[off:off + n], (off, n)
    init.deregister_memory(lm)
    target.call("free", name)


def test_xgmi_proxy_engine_closed_while_resident(proxy_pair):
    """An engine torn down right after a proxied transfer (grid still resident)
    stops its grid: nothing keeps spinning on the GPU afterwards."""
    import gc

    _, target, tdev = proxy_pair
    rm = target.alloc("proxy-close", 1 << 20, tdev)
    local = _rand(1 << 20, "cuda:0", 3)
    for i in range(3):
        e = _initiator(f"proxy-close-{i}", backends=("XGMI",),
                       xgmi=XgmiBackendConfig(proxy_blocks=2, proxy_idle_us=10_000_000))
        e.register_remote_engine(target.desc)
        lm = e.register_torch_tensor(local)
        st = e.create_session(lm, rm).write(0, 0, 1 << 20, 1)
        assert st.WaitFor(10_000) == StatusCode.SUCCESS, st.Message()
        # (idle limit 10 s: only the teardown can make the grid leave within 5 s)
        if i == 0:
            e.remove_backend(BackendType.XGMI)
        del e, lm, st
        gc.collect()
        assert _synchronize_returns(), "a closed engine's copy proxy is still resident"
    got = torch.frombuffer(bytearray(target.call("get", ("proxy-close", 0, 1 << 20))), dtype=torch.uint8)
    assert torch.equal(got, local.cpu())
    target.call("free", "proxy-close")


@pytest.mark.parametrize("size", [1, 4096, 1 << 20, 64 << 20], ids=["1B", "4KiB", "1MiB", "64MiB"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_tcp_backend_with_gpu_memory(op, size):
    """The TCP backend stages GPU memory through pinned buffers (XGMI disabled)."""
    tdev = 1 if _two_gpus() else 0
    target = GpuTarget(f"tcp-gpu-target-{op}-{size}", backends=("TCP",), auto_xgmi=False)
    try:
        init = _initiator(f"tcp-gpu-init-{op}-{size}", backends=("TCP",), auto_xgmi=False)
        init.register_remote_engine(target.desc)
        rm = target.alloc("t", 2 * size + 64, tdev, offset=512)
        local = torch.full((2 * size + 64,), 0xA5, dtype=torch.uint8, device="cuda:0")
        lm = init.register_torch_tensor(local)
        assert init.route_of(lm, rm) == BackendType.TCP
        payload = _rand(2 * size + 64, "cuda:0", size)
        if op == "write":
            local.copy_(payload)
            target.call("fill", ("t", 0))
            offs = [0, size + 32]
            st = init.batch_write([lm], [offs], [rm], [offs[::-1]], [[size, size]], [1])[0]
        else:
            target.call("put", ("t", 0, payload.cpu().numpy().tobytes()))
            offs = [0, size + 32]
            st = init.batch_read([lm], [offs], [rm], [offs[::-1]], [[size, size]], [1])[0]
        assert st.WaitFor(60_000) == StatusCode.SUCCESS, st.Message()
        torch.cuda.synchronize()
        if op == "write":
            remote = torch.frombuffer(bytearray(target.call("get", ("t", 0, 2 * size + 64))), dtype=torch.uint8)
            assert torch.equal(remote[size + 32:2 * size + 32], payload[:size].cpu())
            assert torch.equal(remote[:size], payload[size + 32:2 * size + 32].cpu())
        else:
            assert torch.equal(local[:size].cpu(), payload[size + 32:2 * size + 32].cpu())
            assert torch.equal(local[size + 32:2 * size + 32].cpu(), payload[:size].cpu())
    finally:
        target.close()
