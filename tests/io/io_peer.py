"""The IO tests' peer processes (they live in mori_core.bench.peer, shared with the chaos harness)."""

from mori_core.bench.peer import LocalBuffer, PeerProcess, TargetProcess, process_stats  # noqa: F401
