"""MORI-SHMEM: symmetric memory across the GPUs of one node (MORI's ``mori.shmem`` API).

Each rank (one process per GPU) owns a heap of ``MORI_SHMEM_HEAP_SIZE`` bytes (default 4G;
strings like "6G") on its current CUDA device. Every rank maps every other rank's heap through
CUDA IPC, so an allocation made by the same sequence of ``shmem_malloc`` calls on every rank
sits at the same offset everywhere and kernels reach a peer's copy at ``peer_base + offset``.

Initialise with a registered torch process group::

    torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
    mori_core.shmem.shmem_torch_process_group_init("default")

or without torch.distributed::

    uid = shmem_get_unique_id()            # on rank 0; send the bytes to every rank
    shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world_size, uid)
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Optional

from mori_core.shmem.bootstrap import Bootstrap, new_unique_id, parse_unique_id

MORI_SHMEM_INIT_WITH_MPI_COMM = 0
MORI_SHMEM_INIT_WITH_UNIQUEID = 1

__all__ = [
    "MORI_SHMEM_INIT_WITH_MPI_COMM",
    "MORI_SHMEM_INIT_WITH_UNIQUEID",
    "shmem_barrier_all",
    "shmem_finalize",
    "shmem_free",
    "shmem_get_unique_id",
    "shmem_init_attr",
    "shmem_malloc",
    "shmem_malloc_align",
    "shmem_mpi_init",
    "shmem_mype",
    "shmem_npes",
    "shmem_num_qp_per_pe",
    "shmem_ptr_p2p",
    "shmem_torch_process_group_init",
]

_BOOT: Optional[Bootstrap] = None
# Called (newest first) by shmem_finalize before the heap goes: engines bootstrapped over this
# shmem instance (NVSHMEM for the inter-node EP kernels) tear down here.
_FINALIZERS: list[Callable[[], None]] = []


def _core() -> Any:
    from mori_core import _C

    if not hasattr(_C, "shmem_init_local"):
        raise RuntimeError(
            "this mori_core build has no symmetric memory (built without nvcc/hipcc); shmem needs a GPU build"
        )
    return _C


def shmem_get_unique_id() -> bytes:
    """Create the bootstrap id (128 bytes) on one rank, typically rank 0; pass it to every
    rank's :func:`shmem_init_attr`. This process serves the bootstrap store and must stay alive
    while the others initialise."""
    return new_unique_id()


def shmem_init_attr(flags: int, rank: int, world_size: int, unique_id: Any) -> int:
    """Initialise shmem on this rank (collective over ``world_size`` ranks); returns 0.

    Args:
        flags: ``MORI_SHMEM_INIT_WITH_UNIQUEID`` (MPI bootstrap is not supported).
        rank, world_size: this rank and the number of ranks (all on one node).
        unique_id: bytes from :func:`shmem_get_unique_id`.
    """
    global _BOOT
    if flags == MORI_SHMEM_INIT_WITH_MPI_COMM:
        raise NotImplementedError("MPI bootstrap is not supported; use MORI_SHMEM_INIT_WITH_UNIQUEID")
    if flags != MORI_SHMEM_INIT_WITH_UNIQUEID:
        raise ValueError(f"flags={flags!r} must be MORI_SHMEM_INIT_WITH_UNIQUEID ({MORI_SHMEM_INIT_WITH_UNIQUEID})")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
    core = _core()
    if _BOOT is not None or core.shmem_initialized():
        raise RuntimeError("mori shmem is already initialised in this process; call shmem_finalize() first")
    uid = parse_unique_id(unique_id)
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("mori shmem needs a CUDA device (torch.cuda.is_available() is False)")
    device = torch.cuda.current_device()
    boot = Bootstrap.connect(uid, rank, world_size)
    try:
        local = dict(core.shmem_init_local(rank, world_size, device))
        local["host"] = socket.gethostname()
        infos = boot.all_gather("heap", local)
        # CUDA IPC reaches only the GPUs of this host: peers on other nodes stay unmapped (the
        # inter-node EP kernels reach them through NVSHMEM instead).
        for info in infos:
            if info.pop("host") != local["host"]:
                info["ipc_handle"] = b""
        sizes = {int(i["size"]) for i in infos}
        if len(sizes) != 1:
            raise RuntimeError(
                f"ranks have different heap sizes {sorted(sizes)}; set the same MORI_SHMEM_HEAP_SIZE on every rank"
            )
        core.shmem_open_peers(infos)
        boot.barrier("init")
    except BaseException:
        core.shmem_finalize_local()
        raise
    _BOOT = boot
    return 0


def _resolve_group(group_name: str) -> Any:
    import torch

    c10d = torch._C._distributed_c10d
    if hasattr(c10d, "_resolve_process_group"):
        return c10d._resolve_process_group(group_name)
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(group_name)


def shmem_torch_process_group_init(group_name: str) -> int:
    """Initialise shmem over a registered torch process group (MORI's recommended path).

    ``group_name`` is a name registered with
    ``torch._C._distributed_c10d._register_process_group(name, group)``; its rank 0 creates the
    unique id and broadcasts it over the group. Returns 0.
    """
    import torch.distributed as dist

    try:
        pg = _resolve_group(group_name)
    except Exception as e:
        raise ValueError(
            f"process group {group_name!r} is not registered; call "
            f"torch._C._distributed_c10d._register_process_group({group_name!r}, group) first ({e})"
        ) from None
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    obj = [shmem_get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(obj, src=dist.get_global_rank(pg, 0), group=pg)
    return shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world, obj[0])


def shmem_mpi_init() -> int:
    """Not supported (no MPI dependency); use a torch process group or a unique id."""
    raise NotImplementedError("MPI bootstrap is not supported; use shmem_torch_process_group_init or shmem_init_attr")


def shmem_finalize() -> None:
    """Collective teardown: barrier, unmap peers, free the heap. Safe to call when not initialised."""
    global _BOOT
    if _BOOT is None:
        return
    core = _core()
    try:
        while _FINALIZERS:
            _FINALIZERS.pop()()
        core.device_synchronize(core.shmem_device())
        _BOOT.barrier("finalize")
    finally:
        core.shmem_finalize_local()
        _BOOT = None


def _require_boot() -> Bootstrap:
    if _BOOT is None:
        raise RuntimeError(
            "mori shmem is not initialised: call shmem_torch_process_group_init(group_name) or "
            "shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world_size, unique_id) first"
        )
    return _BOOT


def shmem_mype() -> int:
    """This rank."""
    return _require_boot().rank


def shmem_npes() -> int:
    """Number of ranks."""
    return _require_boot().world_size


def shmem_device() -> int:
    """CUDA device index of this rank's heap."""
    _require_boot()
    return int(_core().shmem_device())


def shmem_malloc(size: int) -> int:
    """Allocate ``size`` bytes of symmetric memory (same call sequence on every rank); returns
    the device address. Raises RuntimeError naming MORI_SHMEM_HEAP_SIZE when the heap is full."""
    return shmem_malloc_align(256, size)


def shmem_malloc_align(alignment: int, size: int) -> int:
    """Like :func:`shmem_malloc` with a power-of-two ``alignment``."""
    _require_boot()
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    return int(_core().shmem_malloc(int(size), int(alignment)))


def shmem_free(ptr: int) -> None:
    """Free an address returned by :func:`shmem_malloc`."""
    _require_boot()
    _core().shmem_free(int(ptr))


def shmem_ptr_p2p(dest_ptr: int, my_pe: int, dest_pe: int) -> int:
    """Address, usable on this GPU, of ``dest_ptr``'s twin in ``dest_pe``'s heap."""
    boot = _require_boot()
    if my_pe != boot.rank:
        raise ValueError(f"my_pe={my_pe} is not this rank ({boot.rank})")
    if not 0 <= dest_pe < boot.world_size:
        raise ValueError(f"dest_pe={dest_pe} must be in [0, {boot.world_size})")
    return int(_core().shmem_ptr_p2p(int(dest_ptr), int(dest_pe)))


def shmem_num_qp_per_pe() -> int:
    """RDMA queue pairs per peer: none are used (all peers are intra-node); 1 for MORI parity."""
    return 1


def shmem_barrier_all() -> None:
    """Wait for this GPU's pending work, then for every rank to arrive (host barrier)."""
    boot = _require_boot()
    core = _core()
    core.device_synchronize(core.shmem_device())
    boot.barrier("barrier_all")


def require_initialized(rank: int, world_size: int) -> None:
    """Raise unless shmem is initialised with this rank/world size (used by the EP op)."""
    boot = _require_boot()
    if (boot.rank, boot.world_size) != (rank, world_size):
        raise ValueError(
            f"config rank/world_size ({rank}/{world_size}) differ from shmem's ({boot.rank}/{boot.world_size})"
        )


def exchange(tag: str, obj: Any) -> list[Any]:
    """Collective: every rank's picklable ``obj``, indexed by rank, over the shmem bootstrap
    store (bounded by MORI_BOOTSTRAP_TIMEOUT). Other engines bootstrap through it."""
    return _require_boot().all_gather(f"x_{tag}", obj)


def register_finalizer(fn: Callable[[], None]) -> None:
    """Run ``fn`` in :func:`shmem_finalize`, before the heap is freed (newest first)."""
    _require_boot()
    _FINALIZERS.append(fn)


def verify_symmetric(tag: str, value: int) -> None:
    """Collective: synchronise this GPU, then check every rank passes the same ``value``
    (e.g. a heap offset). Raises RuntimeError naming the ranks that differ."""
    boot = _require_boot()
    core = _core()
    core.device_synchronize(core.shmem_device())
    values = boot.all_gather(f"sym_{tag}", int(value))
    if len(set(values)) != 1:
        raise RuntimeError(
            f"symmetric allocation '{tag}' differs between ranks: {values}; every rank must create and free "
            "symmetric buffers (EP ops) in the same order"
        )
