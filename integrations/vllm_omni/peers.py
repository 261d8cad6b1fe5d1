"""The receiver engines a sender writes to: a bounded table that evicts safely.

Every pull names its receiver's packed ``EngineDesc``; the sender registers that
engine with its IO engine once. The table holds at most ``capacity`` engines:
when full, the least recently used engine that no pull is using right now is
deregistered to make room, so neither a burst of forged pulls (without a secret)
nor receivers that come and go can lock new receivers out. Only when every
engine is in use is a new one refused.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

__all__ = ["RemoteEngines"]


class RemoteEngines:
    """Thread-safe LRU of registered remote engines with in-use counts.

    Args:
        engine: this side's ``IOEngine``.
        io: the ``mori_core.io`` module (``EngineDesc``).
        capacity: engines registered at most.
    """

    def __init__(self, engine: Any, io: Any, capacity: int) -> None:
        self._engine = engine
        self._io = io
        self._capacity = capacity
        self._lock = threading.Lock()
        # engine key -> [packed desc, desc, pulls using it]; order = least recently used first
        self._table: "collections.OrderedDict[str, list]" = collections.OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    def acquire(self, packed: bytes) -> Any:
        """Register (or reuse) the engine ``packed`` describes and mark it in use; returns its desc.

        Raises:
            ValueError: not a packed EngineDesc. RuntimeError: the table is full of engines in use.
        """
        desc = self._io.EngineDesc.unpack(packed)
        victim = None
        with self._lock:
            entry = self._table.get(desc.key)
            if entry is None:
                if len(self._table) >= self._capacity:
                    idle = next((k for k, e in self._table.items() if e[2] == 0), None)
                    if idle is None:
                        raise RuntimeError(f"{self._capacity} receiver engines are all in use; refusing a new one")
                    victim = self._table.pop(idle)[1]
                    self.evicted += 1
                entry = self._table[desc.key] = [None, desc, 0]
            self._table.move_to_end(desc.key)
            if entry[0] != packed:  # new, or restarted elsewhere under the same key
                self._engine.register_remote_engine(desc)
                entry[0], entry[1] = packed, desc
            entry[2] += 1
        if victim is not None:  # no pull uses it: its link can go
            self._engine.deregister_remote_engine(victim)
        return entry[1]

    def release(self, key: str) -> None:
        """One pull stopped using engine ``key``."""
        with self._lock:
            entry = self._table.get(key)
            if entry is not None and entry[2] > 0:
                entry[2] -= 1

    def close(self) -> list[Any]:
        """Forget every engine; returns their descs (the caller deregisters them)."""
        with self._lock:
            descs = [e[1] for e in self._table.values()]
            self._table.clear()
        return descs
