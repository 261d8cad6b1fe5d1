"""``Communicator``: the rendezvous an EPv2 op is built on (MORI's ``mori.cco.communicator``).

Two kinds, chosen by the machine:

* **GPU** (a CUDA device and a GPU build): the unique id bootstraps :mod:`mori_core.shmem` (the
  symmetric heap the EP kernels use). One heap serves a process: a second ``init`` with the same
  rank and size reuses it (SGLang makes one communicator per EP op), a different rank or size is
  an error. The heap is ``MORI_SHMEM_HEAP_SIZE`` of device memory (default 4G), allocated when it
  is created; ``per_rank_vmm`` (the virtual address space MORI reserves per communicator) is
  accepted and not used. An op that does not fit the heap fails naming MORI_SHMEM_HEAP_SIZE.
* **CPU**: the communicator rides on an initialised torch.distributed group (default: the
  world group, gloo); EPv2 ops then run mori_core's reference engine over it.

Every wait is bounded: heap bootstrap and barriers by ``MORI_BOOTSTRAP_TIMEOUT`` (seconds).
"""

from __future__ import annotations

import socket
from typing import Any, Optional, Union

import torch

from mori_core.cco.cco import DevCommRequirements

__all__ = ["Communicator", "DevCommHandle", "UniqueId", "get_unique_id"]


class UniqueId:
    """Rendezvous token (picklable bytes): made on rank 0, broadcast to every rank."""

    def __init__(self, data: bytes) -> None:
        self._data = bytes(data)

    def __bytes__(self) -> bytes:
        return self._data

    def __getstate__(self) -> bytes:
        return self._data

    def __setstate__(self, state: bytes) -> None:
        self._data = bytes(state)

    @staticmethod
    def from_bytes(b: Union[bytes, bytearray, memoryview]) -> "UniqueId":
        return UniqueId(bytes(b))

    def __repr__(self) -> str:
        return f"<UniqueId: {self._data[:8].hex()}...>"


def get_unique_id() -> UniqueId:
    """Create a rendezvous token (call on rank 0; this process serves the bootstrap store and must
    stay alive while the others join)."""
    from mori_core.shmem import shmem_get_unique_id

    return UniqueId(shmem_get_unique_id())


def _gpu_heap_available() -> bool:
    if not torch.cuda.is_available():
        return False
    from mori_core import _C

    return hasattr(_C, "shmem_init_local")


def _shmem_rank_size() -> Optional[tuple[int, int]]:
    """(rank, size) of this process's shmem heap, or None when there is none."""
    from mori_core import shmem

    try:
        return shmem.shmem_mype(), shmem.shmem_npes()
    except RuntimeError:
        return None


class Communicator:
    """A group of ``nranks`` ranks that EPv2 ops run over (see the module docstring)."""

    DEFAULT_PER_RANK_VMM: int = 4 << 30
    _live_gpu = 0  # GPU communicators alive in this process (they share one heap)
    _heap_owned = False  # the heap was created by a Communicator (and is finalised by the last one)

    def __init__(self) -> None:
        self._rank: Optional[int] = None
        self._nranks: Optional[int] = None
        self.device: torch.device = torch.device("cpu")
        self.group: Any = None  # CPU kind: the torch.distributed group
        self._lsa: tuple[int, int] = (1, 0)  # (ranks sharing this rank's node, rank among them)
        self._valid = False

    @staticmethod
    def get_unique_id() -> UniqueId:
        """Create a rendezvous token on rank 0."""
        return get_unique_id()

    @classmethod
    def init(
        cls,
        nranks: int,
        rank: int,
        unique_id: Union[UniqueId, bytes],
        per_rank_vmm: int = DEFAULT_PER_RANK_VMM,
        *,
        group: Any = None,
    ) -> "Communicator":
        """Collective: join the communicator of ``unique_id`` as ``rank`` of ``nranks``.

        Args:
            nranks, rank: group size and this rank.
            unique_id: the token from rank 0's :meth:`get_unique_id`.
            per_rank_vmm: MORI's per-rank virtual window (bytes); accepted, see the module docstring.
            group: CPU kind only: the torch.distributed group (default: the world group).
        """
        if not isinstance(nranks, int) or nranks < 1:
            raise ValueError(f"nranks must be a positive int, got {nranks!r}")
        if not isinstance(rank, int) or not 0 <= rank < nranks:
            raise ValueError(f"rank={rank!r} must be in [0, nranks={nranks})")
        if not isinstance(per_rank_vmm, int) or per_rank_vmm < 0:
            raise ValueError(f"per_rank_vmm must be a non-negative int (bytes), got {per_rank_vmm!r}")
        comm = cls()
        comm._rank, comm._nranks = rank, nranks
        if _gpu_heap_available() and group is None:
            comm._init_gpu(bytes(unique_id))
        else:
            comm._init_cpu(group)
        comm._valid = True
        return comm

    def _init_gpu(self, uid: bytes) -> None:
        from mori_core import shmem

        current = _shmem_rank_size()
        if current is None:
            shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, self._rank, self._nranks, uid)
            Communicator._heap_owned = True
        elif current != (self._rank, self._nranks):
            raise ValueError(
                f"this process's shmem heap is rank {current[0]} of {current[1]}, the communicator asks for rank "
                f"{self._rank} of {self._nranks}; one process serves one EP group"
            )
        self.device = torch.device("cuda", shmem.shmem_device())
        hosts = shmem.exchange("cco_hosts", socket.gethostname())
        mine = [r for r, h in enumerate(hosts) if h == hosts[self._rank]]
        self._lsa = (len(mine), mine.index(self._rank))
        Communicator._live_gpu += 1

    def _init_cpu(self, group: Any) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "Communicator.init on a machine without a CUDA GPU needs torch.distributed initialised "
                "(e.g. gloo); it runs mori_core's reference EP engine over that group"
            )
        g = group if group is not None else dist.group.WORLD
        if (dist.get_rank(g), dist.get_world_size(g)) != (self._rank, self._nranks):
            raise ValueError(
                f"Communicator rank {self._rank} of {self._nranks} does not match the torch.distributed group "
                f"(rank {dist.get_rank(g)} of {dist.get_world_size(g)}); pass group= the EP group"
            )
        self.group = group
        self._lsa = (self._nranks, self._rank)

    # ------------------------------------------------------------------ properties
    def _check_valid(self, op: str) -> None:
        if not self._valid:
            raise RuntimeError(f"Cannot {op}: Communicator has been destroyed")

    @property
    def is_valid(self) -> bool:
        return self._valid

    @property
    def rank(self) -> int:
        self._check_valid("get rank")
        return self._rank

    @property
    def nranks(self) -> int:
        self._check_valid("get nranks")
        return self._nranks

    @property
    def is_gpu(self) -> bool:
        """True for the GPU kind (EP ops use the kernels), False for the CPU kind (reference)."""
        return self.device.type == "cuda"

    @property
    def lsa_size(self) -> int:
        """Ranks that share this rank's node (reachable over NVLink / one heap mapping)."""
        return self._lsa[0]

    @property
    def lsa_rank(self) -> int:
        return self._lsa[1]

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        """Wait for this rank's GPU work, then for every rank (bounded by MORI_BOOTSTRAP_TIMEOUT)."""
        self._check_valid("barrier")
        if self.is_gpu:
            from mori_core import shmem

            shmem.shmem_barrier_all()
            return
        import torch.distributed as dist

        from mori_core.shmem.bootstrap import bootstrap_timeout

        if "gloo" in str(dist.get_backend(self.group)):
            dist.monitored_barrier(group=self.group, timeout=bootstrap_timeout())
        else:
            dist.barrier(group=self.group)

    def create_dev_comm(self, requirements: Optional[DevCommRequirements] = None) -> "DevCommHandle":
        """A :class:`DevCommHandle` of this communicator."""
        self._check_valid("create_dev_comm")
        return DevCommHandle(self, requirements)

    def destroy(self) -> None:
        """Leave the communicator. The last GPU communicator finalises the heap it created
        (collective then: every rank destroys its communicators in the same order)."""
        if not self._valid:
            return
        self._valid = False
        if self.is_gpu:
            Communicator._live_gpu -= 1
            if Communicator._live_gpu == 0 and Communicator._heap_owned:
                from mori_core import shmem

                Communicator._heap_owned = False
                shmem.shmem_finalize()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *_: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        if not self._valid:
            return "<Communicator: destroyed>"
        kind = "gpu" if self.is_gpu else "cpu"
        return f"<Communicator: rank={self._rank}/{self._nranks}, {kind}, lsa_size={self.lsa_size}>"


class DevCommHandle:
    """Team layout of a communicator (MORI's device-communicator handle; mori_core's kernels need
    no device communicator object, so this only reports ranks)."""

    def __init__(self, comm: Communicator, requirements: Optional[DevCommRequirements] = None) -> None:
        comm._check_valid("create a DevCommHandle")
        self._comm = comm
        self.requirements = requirements if requirements is not None else DevCommRequirements()
        self._closed = False

    def _check(self) -> Communicator:
        if self._closed:
            raise RuntimeError("DevCommHandle has already been closed")
        return self._comm

    @property
    def rank(self) -> int:
        return self._check().rank

    @property
    def world_size(self) -> int:
        return self._check().nranks

    @property
    def lsa_size(self) -> int:
        """Ranks sharing this rank's node."""
        return self._check().lsa_size

    @property
    def lsa_rank(self) -> int:
        return self._check().lsa_rank

    def close(self) -> None:
        """Release the handle (safe to call twice)."""
        self._closed = True
