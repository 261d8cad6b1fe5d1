"""What a prefill rank knows about its decode peers and about each request's destinations."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import numpy.typing as npt

from mori_core.io import EngineDesc, MemoryDesc
from mori_integrations.sglang.messages import ControlMessageError, PeerRegistration, TransferMetadata
from mori_integrations.sglang.plans import HeadSlice


@dataclasses.dataclass
class DecodePeer:
    """One decode rank as registered with this prefill rank (``decode_kv_args_table`` value)."""

    registration: PeerRegistration
    engine_desc: EngineDesc
    kv_descs: List[MemoryDesc]
    aux_descs: List[MemoryDesc]
    state_descs: List[List[Optional[MemoryDesc]]]
    # Filled by the manager's compatibility check:
    kv_pairs: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
    state_pairs: List[List[Tuple[int, int]]] = dataclasses.field(default_factory=list)
    head_slice: Optional[HeadSlice] = None  # MHA with a different TP size only
    rejected: Optional[str] = None  # why transfers to this peer cannot work
    # SGLang's Common sender reads this for DCP chunk sizing; DCP relayout is not offered.
    requires_dcp_relayout: bool = False

    @property
    def engine_key(self) -> str:
        return self.engine_desc.key

    @property
    def endpoint(self) -> str:
        return self.registration.endpoint

    @property
    def dst_port(self) -> int:
        return self.registration.rank_port

    @classmethod
    def from_registration(cls, reg: PeerRegistration) -> "DecodePeer":
        """Unpack the descriptors of a validated registration."""
        try:
            return cls(
                registration=reg,
                engine_desc=EngineDesc.unpack(reg.engine_desc),
                kv_descs=[MemoryDesc.unpack(b) for b in reg.kv_descs],
                aux_descs=[MemoryDesc.unpack(b) for b in reg.aux_descs],
                state_descs=[[None if b is None else MemoryDesc.unpack(b) for b in comp] for comp in reg.state_descs],
            )
        except (ValueError, RuntimeError, TypeError) as e:
            raise ControlMessageError(f"registration carries an undecodable descriptor: {e}") from None


@dataclasses.dataclass
class RoomTarget:
    """Where one decode rank wants one request written (``transfer_infos[room][engine_key]``).

    Field names ``endpoint``, ``dst_port``, ``is_dummy`` and ``required_dst_info_num``
    are read by SGLang's ``CommonKVManager``.
    """

    room: int
    endpoint: str
    dst_port: int
    engine_key: str
    dst_pages: npt.NDArray[np.int64]
    aux_index: int
    state_indices: List[npt.NDArray[np.int64]]
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: int

    @classmethod
    def from_metadata(cls, meta: TransferMetadata) -> "RoomTarget":
        return cls(
            room=meta.room,
            endpoint=meta.endpoint,
            dst_port=meta.rank_port,
            engine_key=meta.engine_key,
            dst_pages=meta.page_indices().astype(np.int64),
            aux_index=meta.aux_index,
            state_indices=[np.asarray(s, dtype=np.int64) for s in meta.state_indices],
            required_dst_info_num=meta.required_dst_info_num,
            is_dummy=meta.is_dummy,
            decode_prefix_len=meta.decode_prefix_len,
        )


class RecentRooms:
    """Bounded, expiring room -> reason memory (rooms failed before their sender existed).

    A decode can abort, or be rejected, before the prefill scheduler creates the
    request's sender; the sender must then fail at once instead of waiting for
    the bootstrap timeout. Entries expire so the map cannot grow without bound.
    """

    def __init__(self, ttl_s: float, capacity: int = 65536) -> None:
        self._ttl = ttl_s
        self._capacity = capacity
        self._items: "collections.OrderedDict[int, Tuple[float, str]]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, room: int, reason: str) -> None:
        with self._lock:
            self._items[room] = (time.monotonic() + self._ttl, reason)
            self._items.move_to_end(room)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def get(self, room: int) -> Optional[str]:
        """The reason recorded for ``room``, if any and not expired (the entry stays)."""
        with self._lock:
            item = self._items.get(room)
            if item is None:
                return None
            if item[0] < time.monotonic():
                del self._items[room]
                return None
            return item[1]

    def pop(self, room: int) -> Optional[str]:
        reason = self.get(room)
        with self._lock:
            self._items.pop(room, None)
        return reason

    def __len__(self) -> int:
        return len(self._items)


def by_engine_key(infos: Dict[str, RoomTarget]) -> List[RoomTarget]:
    """A snapshot of a room's targets (the control thread may add one concurrently)."""
    return list(infos.values())
