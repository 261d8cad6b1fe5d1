"""Engine choice and tuning of the MORI-CCL collectives: constructor keywords over
environment variables over defaults.

=============================  ===========================  =====================================
keyword                        environment variable         meaning (default)
=============================  ===========================  =====================================
``engine``                     ``MORI_CCL_ENGINE``          ``auto`` (by size), ``ce`` (copy
                                                            engines; ``sdma``/``copy`` accepted),
                                                            ``sm`` (kernels)
``ce_min_bytes``               ``MORI_CCL_CE_MIN_BYTES``    all-gather / all-to-all under auto:
                                                            copy engines from this input size per
                                                            rank (off: the SM path was faster at
                                                            every size of the first GPU run)
``oneshot_max_bytes``          ``MORI_CCL_ONESHOT_MAX_BYTES`` all-reduce: one-shot up to (512K)
``ar_ce_min_bytes``            ``MORI_CCL_AR_CE_MIN_BYTES`` all-reduce under auto: copy engines
                                                            from (off, same reason); two-shot
                                                            kernels above ``oneshot_max_bytes``
``sm_blocks``                  ``MORI_CCL_SM_BLOCKS``       most blocks of an SM collective (0:
                                                            by collective, see ``SM_BLOCKS``)
``sm_threads``                 ``MORI_CCL_SM_THREADS``      threads per block (512)
``reduce_blocks``              ``MORI_CCL_REDUCE_BLOCKS``   copy-engine all-reduce's local reduce
                                                            grid (0: 2 per SM)
``timeout_s``                  ``MORI_CCL_TIMEOUT_S``       bound of every wait for a peer (30)
``ce_batch``                   ``MORI_CCL_CE_BATCH``        batch stream memory operations (1)
``ce_signal``                  ``MORI_CCL_CE_SIGNAL``       how the copy-engine path signals a
                                                            peer: ``memop`` (stream write
                                                            operation) or ``copy`` (4-byte copy)
``ce_split``                   ``MORI_CCL_CE_SPLIT``        copy engines: streams (copies in
                                                            flight) per peer, 1..8 (0: by
                                                            collective, see ``CE_SPLIT``)
``ce_piece_min_bytes``         ``MORI_CCL_CE_PIECE_MIN_BYTES`` no split piece below this (1M)
=============================  ===========================  =====================================

Sizes accept ``4096``, ``512K``, ``4M``, ``1G``, and ``off`` (never) for the thresholds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

ENGINES = {"auto": 0, "ce": 1, "sdma": 1, "copy": 1, "sm": 2}
ENGINE_ENV = "MORI_CCL_ENGINE"
NEVER_BYTES = 1 << 62  # a threshold that is never reached ("off"; the native kNeverBytes)
# sm_blocks=0: the grid by collective, from the first GPU run's sweep (4x H100: all-gather was
# fastest with 64 blocks, all-to-all and the two-shot all-reduce with 128; small calls use
# fewer, one block per sm_threads 16-byte units).
SM_BLOCKS = {"allgather": 64, "all2all": 128, "allreduce": 128}
# ce_split=0: copies in flight per peer by collective. The all-to-all moved its bytes 1.4-1.5x
# faster with one copy per peer than with two at 64 and 256 MiB in two 4x H100 runs (its pulls
# are staggered by per-peer staging and signals); the all-gather and all-reduce showed no
# difference beyond run-to-run noise, and keep two.
CE_SPLIT = {"allgather": 2, "all2all": 1, "allreduce": 2}

_ENV = {
    "engine": ENGINE_ENV,
    "ce_min_bytes": "MORI_CCL_CE_MIN_BYTES",
    "oneshot_max_bytes": "MORI_CCL_ONESHOT_MAX_BYTES",
    "ar_ce_min_bytes": "MORI_CCL_AR_CE_MIN_BYTES",
    "sm_blocks": "MORI_CCL_SM_BLOCKS",
    "sm_threads": "MORI_CCL_SM_THREADS",
    "reduce_blocks": "MORI_CCL_REDUCE_BLOCKS",
    "timeout_s": "MORI_CCL_TIMEOUT_S",
    "ce_batch": "MORI_CCL_CE_BATCH",
    "ce_signal": "MORI_CCL_CE_SIGNAL",
    "ce_split": "MORI_CCL_CE_SPLIT",
    "ce_piece_min_bytes": "MORI_CCL_CE_PIECE_MIN_BYTES",
}


def parse_bytes(value: str | int, what: str) -> int:
    """``4096``, ``512K``, ``4M``, ``1G`` (also ``4MiB``) -> bytes, ``off``/``never`` ->
    :data:`NEVER_BYTES`; ValueError naming ``what``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{what}={value} must be >= 0")
        return min(value, NEVER_BYTES)
    if str(value).strip().lower() in ("off", "never"):
        return NEVER_BYTES
    text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        n = int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)
    except ValueError:
        raise ValueError(f"{what}={value!r} is not a size (bytes, or a number with K/M/G)") from None
    if n < 0:
        raise ValueError(f"{what}={value!r} must be >= 0")
    return min(n, NEVER_BYTES)


@dataclass(frozen=True)
class CclOptions:
    """Resolved options of one collective handle (see the module docstring)."""

    engine: str = "auto"
    ce_min_bytes: int = NEVER_BYTES
    oneshot_max_bytes: int = 512 << 10
    ar_ce_min_bytes: int = NEVER_BYTES
    sm_blocks: int = 0
    sm_threads: int = 512
    reduce_blocks: int = 0
    timeout_s: float = 30.0
    ce_batch: bool = True
    ce_signal: str = "memop"
    ce_split: int = 0
    ce_piece_min_bytes: int = 1 << 20

    @property
    def engine_code(self) -> int:
        return ENGINES[self.engine]

    def blocks_for(self, kind: str) -> int:
        """The SM grid of a ``kind`` handle: ``sm_blocks``, or by collective when 0."""
        return self.sm_blocks or SM_BLOCKS[kind]

    def split_for(self, kind: str) -> int:
        """Copies in flight per peer of a ``kind`` handle's copy engines: ``ce_split``, or by collective when 0."""
        return self.ce_split or CE_SPLIT[kind]

    @classmethod
    def resolve(cls, **given: Optional[object]) -> "CclOptions":
        """Options from keywords (None: not given) over ``MORI_CCL_*`` variables over defaults.
        Raises ValueError naming the keyword or variable and what it accepts."""
        unknown = set(given) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown CCL option(s) {sorted(unknown)}")
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = given.get(f.name)
            what = f.name
            if raw is None and os.environ.get(_ENV[f.name], "") != "":
                raw, what = os.environ[_ENV[f.name]], _ENV[f.name]
            if raw is None:
                continue
            values[f.name] = _convert(f.name, raw, what)
        opts = cls(**values)
        opts._check()
        return opts

    def _check(self) -> None:
        if not 0 <= self.sm_blocks <= 128:
            raise ValueError(f"sm_blocks={self.sm_blocks} must be in [0, 128] (0: by collective)")
        if not 0 <= self.ce_split <= 8:
            raise ValueError(f"ce_split={self.ce_split} must be in [0, 8] (0: by collective)")
        if not (64 <= self.sm_threads <= 1024 and self.sm_threads % 32 == 0):
            raise ValueError(f"sm_threads={self.sm_threads} must be a multiple of 32 in [64, 1024]")
        if self.reduce_blocks < 0:
            raise ValueError(f"reduce_blocks={self.reduce_blocks} must be >= 0")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive")


def _convert(name: str, raw: object, what: str) -> object:
    if name == "engine":
        value = str(raw).strip().lower()
        if value not in ENGINES:
            raise ValueError(f"{what}={raw!r} must be one of {sorted(ENGINES)}")
        return "ce" if ENGINES[value] == 1 else value
    if name == "ce_signal":
        value = str(raw).strip().lower()
        if value not in ("memop", "copy"):
            raise ValueError(f"{what}={raw!r} must be 'memop' or 'copy'")
        return value
    if name.endswith("_bytes"):
        return parse_bytes(raw, what)  # type: ignore[arg-type]
    if name == "timeout_s":
        try:
            return float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{what}={raw!r} is not a number of seconds") from None
    if name == "ce_batch":
        if isinstance(raw, bool):
            return raw
        value = str(raw).strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{what}={raw!r} is not a boolean (use 0/1)")
    try:
        return int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{what}={raw!r} is not an integer") from None
