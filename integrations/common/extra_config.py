"""Typed, bounded reads of a connector's ``extra`` / ``kv_connector_extra_config`` dict.

Frameworks hand connectors a free-form JSON dict. :class:`ExtraConfig` reads one key at a
time with a default and a range; a bad value raises ``ValueError`` naming the owner, the
key, the value and the limit (``"X: extra['port'] must be an int in [1, 65535], got 70000"``),
so a typo never silently becomes a default.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

__all__ = ["ExtraConfig"]

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ExtraConfig:
    """Validating reader over one ``extra`` dict.

    Args:
        owner: name used in error messages (the connector's class name).
        extra: the dict as the framework passed it (``None`` = empty).
    """

    def __init__(self, owner: str, extra: Optional[Mapping[str, Any]]) -> None:
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise TypeError(f"{owner}: config must be a dict, got {type(extra).__name__}")
        self.owner = owner
        self.extra = extra

    def fail(self, key: str, value: Any, limit: str) -> ValueError:
        """The error for ``key`` holding ``value`` outside ``limit``."""
        return ValueError(f"{self.owner}: extra[{key!r}] must be {limit}, got {value!r}")

    def has(self, key: str) -> bool:
        return key in self.extra

    def get_int(self, key: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
        """An int in ``[lo, hi]`` (numeric strings accepted); ``None`` only when that is the default."""
        value = self.extra.get(key, default)
        if value is None:
            return None
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self.fail(key, value, f"an int in [{lo}, {hi}]")
        return value

    def get_float(self, key: str, default: float, lo: float, hi: float) -> float:
        """A number in ``[lo, hi]`` (ints and numeric strings accepted)."""
        value = self.extra.get(key, default)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise self.fail(key, value, f"a number in [{lo}, {hi}]") from None
        if isinstance(value, bool) or not lo <= number <= hi:
            raise self.fail(key, value, f"a number in [{lo}, {hi}]")
        return number

    def get_bool(self, key: str, default: bool) -> bool:
        """A bool; also 0/1 and the strings true/false/yes/no/on/off/1/0."""
        value = self.extra.get(key, default)
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise self.fail(key, value, "a bool (true/false)")

    def get_str(self, key: str, default: Optional[str]) -> Optional[str]:
        value = self.extra.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(key, value, "a string")
        return value

    def get_choice(self, key: str, default: str, choices: Sequence[str]) -> str:
        """One of ``choices`` (compared lower-case, surrounding blanks ignored)."""
        raw = self.extra.get(key, default)
        value = raw.strip().lower() if isinstance(raw, str) else raw
        if value not in choices:
            raise self.fail(key, raw, f"one of {list(choices)}")
        return value

    def get_size(self, key: str, default: int, lo: int, hi: int) -> int:
        """A byte count: an int or a string like ``'512M'`` / ``'4GiB'``, in ``[lo, hi]``."""
        value = self.extra.get(key, default)
        if isinstance(value, str):
            m = _SIZE_RE.match(value)
            if m is None:
                raise self.fail(key, value, f"a byte count like 536870912 or '512M' in [{lo}, {hi}]")
            value = int(m.group(1)) * _SIZE_UNITS[m.group(2).upper()]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self.fail(key, value, f"a byte count in [{lo}, {hi}]")
        return value
