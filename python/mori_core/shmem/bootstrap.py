"""Bootstrap of the symmetric heap: unique ids and a rank-0 TCPStore.

A unique id names a ``torch.distributed.TCPStore`` served by the process that created the id
(no ``init_process_group`` needed). Ranks publish their heap descriptions (IPC handle, pid,
device) under a per-id prefix, read everyone else's, and use the store for host barriers.
"""

from __future__ import annotations

import datetime
import os
import pickle
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

UNIQUE_ID_BYTES = 128
_MAGIC = b"MORIUID1"
HOST_ENV = "MORI_BOOTSTRAP_HOST"
TIMEOUT_ENV = "MORI_BOOTSTRAP_TIMEOUT"  # seconds
_DEFAULT_HOST = "127.0.0.1"  # intra-node: CUDA IPC only works between processes of one node
_DEFAULT_TIMEOUT_S = 300

# Stores this process serves, by unique-id nonce (kept alive for the process lifetime:
# clients of the id connect to it).
_MASTER_STORES: dict[str, Any] = {}


def bootstrap_timeout() -> datetime.timedelta:
    """Bound of every bootstrap wait (MORI_BOOTSTRAP_TIMEOUT seconds, default 300)."""
    raw = os.environ.get(TIMEOUT_ENV, str(_DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {raw}")
    return datetime.timedelta(seconds=seconds)


def _tcp_store(host: str, port: int, is_master: bool) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=is_master, timeout=bootstrap_timeout(), wait_for_workers=False)


def new_unique_id() -> bytes:
    """Start a TCPStore server in this process and return a 128-byte id that names it."""
    host = os.environ.get(HOST_ENV, _DEFAULT_HOST)
    store = _tcp_store(host, 0, is_master=True)
    nonce = secrets.token_hex(8)
    _MASTER_STORES[nonce] = store
    host_b = host.encode()
    if len(host_b) > 64:
        raise ValueError(f"{HOST_ENV}={host!r} is longer than 64 bytes")
    body = _MAGIC + struct.pack("<I16sB", int(store.port), nonce.encode(), len(host_b)) + host_b
    return body.ljust(UNIQUE_ID_BYTES, b"\0")


@dataclass
class UniqueId:
    """Decoded unique id."""

    host: str
    port: int
    nonce: str


def parse_unique_id(uid: Any) -> UniqueId:
    """Decode an id from :func:`new_unique_id` (bytes, bytearray or a uint8 tensor/list)."""
    if not isinstance(uid, (bytes, bytearray)):
        try:
            uid = bytes(bytearray(uid.tolist() if hasattr(uid, "tolist") else uid))
        except Exception:
            raise TypeError(f"unique_id must be bytes from shmem_get_unique_id(), got {type(uid).__name__}") from None
    uid = bytes(uid)
    if len(uid) != UNIQUE_ID_BYTES or not uid.startswith(_MAGIC):
        raise ValueError("unique_id is not a mori_core shmem unique id (expected 128 bytes from shmem_get_unique_id())")
    port, nonce, hlen = struct.unpack_from("<I16sB", uid, len(_MAGIC))
    off = len(_MAGIC) + struct.calcsize("<I16sB")
    return UniqueId(host=uid[off : off + hlen].decode(), port=port, nonce=nonce.decode())


@dataclass
class Bootstrap:
    """Store-backed host collectives of one shmem instance."""

    store: Any
    prefix: str
    rank: int
    world_size: int
    _seq: int = field(default=0)

    @classmethod
    def connect(cls, uid: UniqueId, rank: int, world_size: int) -> "Bootstrap":
        store = _MASTER_STORES.get(uid.nonce)
        if store is None:
            store = _tcp_store(uid.host, uid.port, is_master=False)
        return cls(store=store, prefix=f"mori_shmem/{uid.nonce}", rank=rank, world_size=world_size)

    def _next(self, tag: str) -> str:
        self._seq += 1
        return f"{self.prefix}/{tag}/{self._seq}"

    def all_gather(self, tag: str, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), indexed by rank; bounded by the bootstrap timeout."""
        base = self._next(tag)
        self.store.set(f"{base}/{self.rank}", pickle.dumps(obj))
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, bootstrap_timeout())
        except Exception as e:  # torch raises DistStoreError/RuntimeError on timeout
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise RuntimeError(
                f"mori shmem bootstrap '{tag}' on rank {self.rank}: ranks {missing} did not arrive within "
                f"{bootstrap_timeout().total_seconds():.0f} s ({TIMEOUT_ENV}); {e}"
            ) from None
        return [pickle.loads(self.store.get(k)) for k in keys]

    def barrier(self, tag: str = "barrier") -> None:
        """Host barrier of all ranks."""
        self.all_gather(tag, None)
