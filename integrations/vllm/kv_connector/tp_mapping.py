"""Which KV heads a prefill rank sends to a decode rank when their TP sizes differ.

vLLM shards KV heads over tensor-parallel ranks: with ``tp <= total`` heads, rank
``r`` holds heads ``[r * total/tp, (r+1) * total/tp)``; with ``tp > total``, each head is
replicated on ``tp/total`` consecutive ranks (rank ``r`` holds head ``r // (tp/total)``).
MLA caches are not sharded (every rank holds the whole latent cache: ``replicated``).

A decode head held by several prefill ranks is taken from one of them, chosen by the
decode rank so that decode ranks spread over the replicas. Both sides evaluate the
same pure functions, so a prefill rank knows what to write and a decode rank what to
read or wait for without asking.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

__all__ = ["cached_head_pairs", "heads_of_rank", "head_pairs", "source_rank"]


def _check(total: int, tp: int, rank: int) -> None:
    if total < 1 or tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"invalid TP layout: {total} KV heads, tp {tp}, rank {rank}")
    if (tp <= total and total % tp) or (tp > total and tp % total):
        raise ValueError(f"{total} KV heads cannot be sharded over tensor-parallel size {tp}")


def heads_of_rank(total: int, tp: int, rank: int, replicated: bool = False) -> List[int]:
    """Global head ids held by ``rank`` of a TP group of size ``tp``, in local order."""
    if replicated:
        return list(range(total))
    _check(total, tp, rank)
    if tp <= total:
        per = total // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total)]


def source_rank(total: int, src_tp: int, head: int, dst_rank: int, replicated: bool = False) -> int:
    """The prefill rank that provides global ``head`` to decode rank ``dst_rank``."""
    holders = [r for r in range(src_tp) if head in heads_of_rank(total, src_tp, r, replicated)]
    if not holders:
        raise ValueError(f"no rank of tensor-parallel size {src_tp} holds KV head {head} of {total}")
    return holders[dst_rank % len(holders)]


def head_pairs(
    total: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int, replicated: bool = False
) -> List[Tuple[int, int]]:
    """``(local head on src_rank, local head on dst_rank)`` pairs src_rank provides to dst_rank."""
    return list(cached_head_pairs(total, src_tp, src_rank, dst_tp, dst_rank, replicated))


@functools.lru_cache(maxsize=4096)
def cached_head_pairs(
    total: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int, replicated: bool = False
) -> Tuple[Tuple[int, int], ...]:
    """:func:`head_pairs` as an immutable tuple, computed once per layout.

    The transfer path asks for it with every request; a cold Python walk over the heads
    cost ~40 us there (the planner also keys its template cache with this tuple as is).
    """
    src_heads = heads_of_rank(total, src_tp, src_rank, replicated)
    pairs = []
    for dst_local, head in enumerate(heads_of_rank(total, dst_tp, dst_rank, replicated)):
        if source_rank(total, src_tp, head, dst_rank, replicated) == src_rank:
            pairs.append((src_heads.index(head), dst_local))
    return tuple(pairs)
