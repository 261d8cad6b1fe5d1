"""Device choice without a NIC: MORI_RDMA_DEVICES parsing, NIC-to-GPU distance
on a fake sysfs tree, host-memory round robin and RoCE GID selection."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

# ----------------------------------------------------------------- filter


def test_empty_filter_accepts_everything(rdma_testing: ModuleType) -> None:
    assert rdma_testing.parse_device_filter("") == {"exclude": False, "entries": []}
    assert rdma_testing.device_filter_accepts("  ", "mlx5_7", 2)


def test_include_list_with_ports(rdma_testing: ModuleType) -> None:
    f = rdma_testing.parse_device_filter(" mlx5_0 , mlx5_1:2 ")
    assert f == {"exclude": False, "entries": [("mlx5_0", 0), ("mlx5_1", 2)]}
    accepts = rdma_testing.device_filter_accepts
    assert accepts("mlx5_0,mlx5_1:2", "mlx5_0", 1)
    assert accepts("mlx5_0,mlx5_1:2", "mlx5_1", 2)
    assert not accepts("mlx5_0,mlx5_1:2", "mlx5_1", 1)
    assert not accepts("mlx5_0,mlx5_1:2", "mlx5_2", 1)


def test_names_match_exactly_not_by_prefix(rdma_testing: ModuleType) -> None:
    # NCCL_IB_HCA-style prefix matching would let "mlx5_1" select mlx5_10.
    assert not rdma_testing.device_filter_accepts("mlx5_1", "mlx5_10", 1)
    assert rdma_testing.device_filter_accepts("^mlx5_1", "mlx5_10", 1)


def test_exclude_list(rdma_testing: ModuleType) -> None:
    spec = "^mlx5_2, mlx5_3:2"
    assert rdma_testing.parse_device_filter(spec) == {"exclude": True, "entries": [("mlx5_2", 0), ("mlx5_3", 2)]}
    accepts = rdma_testing.device_filter_accepts
    assert accepts(spec, "mlx5_0", 1)
    assert not accepts(spec, "mlx5_2", 1)
    assert accepts(spec, "mlx5_3", 1)
    assert not accepts(spec, "mlx5_3", 2)


def test_unmatched_includes_are_reported(rdma_testing: ModuleType) -> None:
    assert rdma_testing.device_filter_unmatched("mlx5_0,bnxt_re9", ["mlx5_0", "mlx5_1"]) == ["bnxt_re9"]
    assert rdma_testing.device_filter_unmatched("^bnxt_re9", ["mlx5_0"]) == []


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("^", "must be followed by device names"),
        ("mlx5_0,,mlx5_1", "empty entry"),
        ("mlx5_0,", "empty entry"),
        ("mlx5 0", "is not a device name"),
        ("mlx5_0:0", "must be an integer in [1, 255]"),
        ("mlx5_0:x", "must be an integer in [1, 255]"),
        ("mlx5_0:256", "must be an integer in [1, 255]"),
        ("a" * 65, "at most 64 characters"),
    ],
)
def test_bad_filters_name_the_variable(rdma_testing: ModuleType, spec: str, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        rdma_testing.parse_device_filter(spec)
    assert "MORI_RDMA_DEVICES" in str(e.value)
    assert fragment in str(e.value)


# --------------------------------------------------------------- topology


class FakeSysfs:
    """A minimal /sys: PCI device tree, /sys/bus/pci/devices links, infiniband class links."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bus" / "pci" / "devices").mkdir(parents=True)
        (root / "class" / "infiniband").mkdir(parents=True)

    def pci(self, path: str, numa: int = -1) -> str:
        """Creates devices/<path> (e.g. "pci0000:16/0000:16:02.0/0000:17:00.0") and returns its BDF."""
        d = self.root / "devices" / path
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{numa}\n")
        bdf = path.rsplit("/", 1)[-1]
        link = self.root / "bus" / "pci" / "devices" / bdf
        if not link.exists():
            link.symlink_to(os.path.relpath(d, link.parent))
        return bdf

    def nic(self, name: str, path: str, numa: int = -1) -> None:
        self.pci(path, numa)
        d = self.root / "class" / "infiniband" / name
        d.mkdir(parents=True)
        (d / "device").symlink_to(os.path.relpath(self.root / "devices" / path, d))


@pytest.fixture
def dgx_like(tmp_path: Path) -> tuple[FakeSysfs, dict[str, str]]:
    """Two sockets; per socket one root port with a switch holding 2 GPUs and 1 NIC,
    plus a NIC directly on another root port of socket 0."""
    s = FakeSysfs(tmp_path / "sys")
    sw0 = "pci0000:10/0000:10:01.0/0000:11:00.0"
    sw1 = "pci0000:90/0000:90:01.0/0000:91:00.0"
    gpus = {
        "g0": s.pci(f"{sw0}/0000:12:00.0/0000:13:00.0", 0),
        "g1": s.pci(f"{sw0}/0000:12:04.0/0000:14:00.0", 0),
        "g2": s.pci(f"{sw1}/0000:92:00.0/0000:93:00.0", 1),
        "g3": s.pci(f"{sw1}/0000:92:04.0/0000:94:00.0", 1),
    }
    s.nic("mlx5_0", f"{sw0}/0000:12:08.0/0000:15:00.0", 0)
    s.nic("mlx5_1", f"{sw1}/0000:92:08.0/0000:95:00.0", 1)
    s.nic("mlx5_2", "pci0000:20/0000:20:01.0/0000:21:00.0", 0)
    # Same host bridge as socket 0's switch, different root port.
    s.nic("mlx5_3", "pci0000:10/0000:10:02.0/0000:16:00.0", 0)
    return s, gpus


def _ranks(rdma_testing: ModuleType, s: FakeSysfs, gpu: str, nics: list[str]) -> dict[str, tuple[str, int, int]]:
    return {r["nic"]: (r["path"], r["hops"], r["numa"]) for r in rdma_testing.rank_nics(str(s.root), gpu, nics)}


def test_path_classes(rdma_testing: ModuleType, dgx_like: tuple[FakeSysfs, dict[str, str]]) -> None:
    s, g = dgx_like
    r = _ranks(rdma_testing, s, g["g0"], ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_9"])
    assert r["mlx5_0"][0] == "PIX"  # same switch
    assert r["mlx5_3"][0] == "PHB"  # same host bridge only
    assert r["mlx5_2"] == ("NODE", r["mlx5_2"][1], 0)  # other root complex, same NUMA node
    assert r["mlx5_1"][0] == "SYS"  # other socket
    assert r["mlx5_9"][0] == "UNKNOWN"  # not in sysfs


def test_pxb_when_several_bridges_apart(rdma_testing: ModuleType, tmp_path: Path) -> None:
    s = FakeSysfs(tmp_path / "sys")
    gpu = s.pci("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0/0000:04:00.0/0000:05:00.0")
    s.nic("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:06:00.0")
    (path, hops, _), = [(r["path"], r["hops"], r["numa"]) for r in rdma_testing.rank_nics(str(s.root), gpu, ["mlx5_0"])]
    assert path == "PXB"
    assert hops == 6


def test_closest_nic_per_gpu(rdma_testing: ModuleType, dgx_like: tuple[FakeSysfs, dict[str, str]]) -> None:
    s, g = dgx_like
    nics = ["mlx5_2", "mlx5_1", "mlx5_0", "mlx5_3"]  # order must not matter
    pick = rdma_testing.pick_nic_for_gpu
    assert pick(str(s.root), g["g0"], nics, 0) == "mlx5_0"
    assert pick(str(s.root), g["g1"], nics, 1) == "mlx5_0"
    assert pick(str(s.root), g["g2"], nics, 2) == "mlx5_1"
    assert pick(str(s.root), g["g3"], nics, 3) == "mlx5_1"


def test_equally_close_nics_are_shared_out(rdma_testing: ModuleType, tmp_path: Path) -> None:
    # Two NICs under the GPUs' switch: GPU ordinals spread over them.
    s = FakeSysfs(tmp_path / "sys")
    sw = "pci0000:10/0000:10:01.0/0000:11:00.0"
    g0 = s.pci(f"{sw}/0000:12:00.0/0000:13:00.0")
    s.nic("mlx5_0", f"{sw}/0000:12:01.0/0000:14:00.0")
    s.nic("mlx5_1", f"{sw}/0000:12:02.0/0000:15:00.0")
    picks = {rdma_testing.pick_nic_for_gpu(str(s.root), g0, ["mlx5_0", "mlx5_1"], ordinal) for ordinal in range(4)}
    assert picks == {"mlx5_0", "mlx5_1"}


def test_unknown_gpu_falls_back_to_spreading(rdma_testing: ModuleType, dgx_like: tuple[FakeSysfs, dict[str, str]]) -> None:
    s, _ = dgx_like
    nics = ["mlx5_0", "mlx5_1"]
    # No sysfs entry for the GPU: every NIC is UNKNOWN, the ordinal spreads GPUs.
    got = [rdma_testing.pick_nic_for_gpu(str(s.root), "0000:ee:00.0", nics, i) for i in range(4)]
    assert got == ["mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]


@pytest.mark.parametrize(
    "raw, norm",
    [("0000:1B:00.0", "0000:1b:00.0"), ("00000000:1b:00.0", "0000:1b:00.0"), ("0001:c1:1f.7", "0001:c1:1f.7"),
     ("1b:00.0", ""), ("0000:1b:00", ""), ("0000:zz:00.0", ""), ("12340000:1b:00.0", "")],
)
def test_bus_id_normalisation(rdma_testing: ModuleType, raw: str, norm: str) -> None:
    assert rdma_testing.normalize_bus_id(raw) == norm


def test_host_memory_round_robin_prefers_local_numa(rdma_testing: ModuleType) -> None:
    pick = rdma_testing.pick_nic_for_host_memory
    numa = [0, 1, 0, 1]
    assert [pick(numa, 1, c) for c in range(4)] == [1, 3, 1, 3]
    assert [pick(numa, 0, c) for c in range(3)] == [0, 2, 0]
    assert [pick(numa, -1, c) for c in range(5)] == [0, 1, 2, 3, 0]  # unknown node: all NICs
    assert [pick(numa, 5, c) for c in range(2)] == [0, 1]  # no local NIC: all NICs


# --------------------------------------------------------------------- GID

V4 = "0000:0000:0000:0000:0000:ffff:0a00:0001"  # ::ffff:10.0.0.1
LL = "fe80:0000:0000:0000:0250:56ff:feaa:bbcc"
G6 = "2001:0db8:0000:0000:0000:0000:0000:0001"
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def _gid_port(root: Path, entries: dict[int, tuple[str, str]]) -> None:
    port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    for i, (gid, typ) in entries.items():
        (port / "gids" / str(i)).write_text(gid + "\n")
        if typ:
            (port / "gid_attrs" / "types" / str(i)).write_text(typ + "\n")


def test_gid_table_from_sysfs(rdma_testing: ModuleType, tmp_path: Path) -> None:
    _gid_port(tmp_path, {0: (LL, "IB/RoCE v1"), 1: (LL, "RoCE v2"), 2: (V4, "IB/RoCE v1"), 3: (V4, "RoCE v2"),
                         4: (ZERO, ""), 5: ("garbage", "")})
    table = rdma_testing.read_gid_table(str(tmp_path), "mlx5_0", 1, 8)
    assert table == [(0, LL, "RoCE v1"), (1, LL, "RoCE v2"), (2, V4, "RoCE v1"), (3, V4, "RoCE v2")]
    assert rdma_testing.choose_gid_index(table) == 3


@pytest.mark.parametrize(
    "entries, best",
    [
        ([(0, LL, "RoCE v1"), (1, LL, "RoCE v2"), (2, G6, "RoCE v2"), (3, V4, "RoCE v2")], 3),
        ([(0, LL, "RoCE v1"), (1, LL, "RoCE v2"), (2, G6, "RoCE v2")], 2),
        ([(0, LL, "RoCE v1"), (1, LL, "RoCE v2")], 1),
        ([(0, LL, "RoCE v1"), (5, V4, "RoCE v1")], 0),  # v1 only: the first one
        ([(0, LL, ""), (1, V4, "")], 1),  # no type information: IPv4-mapped first
        ([(0, ZERO, "RoCE v2")], -1),
        ([], -1),
    ],
)
def test_gid_preference(rdma_testing: ModuleType, entries: list[tuple[int, str, str]], best: int) -> None:
    assert rdma_testing.choose_gid_index(entries) == best
